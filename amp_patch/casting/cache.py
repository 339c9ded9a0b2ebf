"""The O1 cast cache and the caster that uses it (the fp32 -> half cast of a parameter, once per region)."""
import threading

import torch

from .._torch.compat import tracing as dynamo_tracing
from ..config.dtypes import FP32, HALF_DTYPES
from .switch import live_while_tracing

Tensor = torch.Tensor
Parameter = torch.nn.Parameter
# ``t.half()`` / ``t.bfloat16()`` parse no arguments: measurably cheaper per call than ``t.to(dtype=...)``
_HALF_METHOD = {torch.float16: Tensor.half, torch.bfloat16: Tensor.bfloat16}


class CastCache:
    """Cache of fp32 parameter -> half casts, used only inside a region amp_patch knows.

    Keyed by ``id`` of the source parameter; an entry holds the source (so the id
    cannot be reused while cached), its ``_version`` at cast time, the grad mode
    of the cast and the cast tensor. An entry made under ``no_grad`` never
    serves a grad-mode call, and an in-place change of the source invalidates it.

    Writes through ``.data`` (``p.data = w``, ``p.data.copy_(w)``, ``vector_to_parameters``) move neither
    ``p._version`` (``.data`` has its own version counter) nor, for ``copy_``, the storage pointer, so no key can
    see them. So the cache is read and filled only in a thread that is inside a region: a forward of a session's
    model (``forwards``, the engine's per-thread depth) or an ``amp_patch.autocast()`` region (``regions``); it is
    dropped as each such forward starts and ends, as each region opens (the outermost) and exits (like
    torch.autocast, which drops its cache when the outermost region exits) and at scale_loss. Anywhere else (a
    submodule or a model not passed to initialize, called directly) casts are not cached: never stale, and nothing
    is kept alive.
    Only ``nn.Parameter`` leaves are cached (torch caches any leaf that requires grad): a fresh input leaf per
    iteration (adversarial attacks, input-gradient evaluation) is never worth keeping and would grow the cache.
    """

    def __init__(self, forwards=None):
        self.entries = {}
        self.forwards = {} if forwards is None else forwards  # thread ident -> open session-model forwards
        self.regions = {}  # thread ident -> open amp_patch.autocast() regions

    def outside(self, ident):
        return ident not in self.forwards and ident not in self.regions

    def enter_region(self):
        """Open an autocast() region in this thread; the outermost starts empty (nothing cached before it)."""
        ident = threading.get_ident()
        if self.outside(ident):
            self.entries.clear()
        self.regions[ident] = self.regions.get(ident, 0) + 1

    def exit_region(self):
        """Leave an autocast() region of this thread and drop the casts (even a nested region's exit drops)."""
        ident = threading.get_ident()
        depth = self.regions.get(ident, 0) - 1
        if depth > 0:
            self.regions[ident] = depth
        else:
            self.regions.pop(ident, None)
        self.entries.clear()

    def clear(self):
        self.entries.clear()

    def __len__(self):
        return len(self.entries)


def make_to_half(half_dtype, cache, disabled=None):
    """The caster for ``half`` ops: fp32 (cached, in a region, for parameters) and the other 16-bit dtype; while
    dynamo traces, it also asks the live switch ``disabled`` (see ``switch.live_while_tracing``)."""
    other = next(d for d in HALF_DTYPES if d is not half_dtype)
    off_while_tracing = live_while_tracing(disabled if disabled is not None else {})
    cast = _HALF_METHOD[half_dtype]
    entries, forwards, regions = cache.entries, cache.forwards, cache.regions
    get = entries.get
    get_ident = threading.get_ident
    grad_enabled = torch.is_grad_enabled
    compiling = dynamo_tracing
    tracing = torch._C._is_tracing

    def to_half(t):
        dt = t.dtype
        if dt is FP32:
            if compiling():  # dynamo: no data-dependent cache checks in the graph (it casts once)
                return t if off_while_tracing() else cast(t)
            if type(t) is Tensor:  # an activation (the common case, tested first): never cached
                return cast(t)
            if tracing():  # torch.jit.trace: a cast cached before the trace would become a graph constant
                return cast(t)
            ident = get_ident()
            if ident not in forwards and ident not in regions:  # no region known here: see CastCache
                return cast(t)
            hit = get(id(t))
            if hit is not None and hit[0] is t and hit[1] == t._version and (hit[2] or not grad_enabled()):
                return hit[3]
            out = cast(t)
            if t.requires_grad and isinstance(t, Parameter) and t.is_leaf:
                entries[id(t)] = (t, t._version, grad_enabled(), out)
            return out
        if dt is other:
            return cast(t)
        return t

    return to_half
