"""Replay one batch and find the first op whose output (or the gradient of its output) leaves the half range.

A TorchFunctionMode sees every torch call with the arguments the casting wrappers passed on, so it sees the
dtypes each op really ran in. An op is the origin of a bad value when its floating inputs are all finite and
its output holds inf/NaN or, in a half dtype, magnitudes beyond the dtype's largest finite value.

Some non-finite values are intended: a mask written with ``-inf`` (``masked_fill(mask, -inf)``), or two
``finfo.min`` masks added (Hugging Face's eager GPT-2: causal plus padding, ``-inf`` in float32). The float32 replay
records where each op's output is non-finite (by module, op and call number: :class:`Intended`); when its loss and
gradients are finite, those values are the model's own, and a half-precision replay counts an op's non-finite
output as bad only where float32's was finite (and takes such values as finite inputs of the ops that read them).
"""
import dataclasses
import math

import torch
from torch.overrides import TorchFunctionMode

from ...casting.wrappers import cast_tree, iter_tensors
from ...config.dtypes import HALF_DTYPES
from ...observe.trace import running_modules
from ...session import api as frontend
from ...session import state as _state

_MAX_EVENTS = 32
_CASTS = frozenset(("half", "bfloat16", "to", "type"))  # a wrapper's cast of an fp32 argument into half


@dataclasses.dataclass
class Culprit:
    """One op that produced a bad value: where, what, why it ran in that dtype, and the evidence."""

    module: str
    target: str
    name: str
    category: str
    source: str
    where: str  # "output" or "gradient"
    dtypes: tuple
    max_abs: float  # the output's largest |value| recomputed in float32 (inf: not finite even there)

    @property
    def qualname(self):
        return f"{self.target}.{self.name}"

    def as_dict(self):
        return {"module": self.module, "op": self.qualname, "category": self.category, "source": self.source,
                "where": self.where, "input_dtypes": [str(d).replace("torch.", "") for d in self.dtypes],
                "max_abs_float32": self.max_abs}


@dataclasses.dataclass
class Replay:
    """The outcome of one forward + backward of the failing batch."""

    loss: float
    grads_finite: bool
    culprits: list
    bad_inputs: list  # indices of model inputs that already hold inf/NaN
    intended: dict = dataclasses.field(default_factory=dict)  # the float32 replay's non-finite outputs (Intended)

    @property
    def clean(self):
        return math.isfinite(self.loss) and self.grads_finite and not self.culprits

    @property
    def genuine(self):
        """A float32 replay's verdict: the loss or a gradient is not finite (or the batch already holds inf/NaN).
        Without that, any non-finite op output it saw is the model's own (a mask), not a failure."""
        return not math.isfinite(self.loss) or not self.grads_finite or bool(self.bad_inputs)

    def intended_ops(self):
        """``module: op`` of the ops whose non-finite outputs the float32 replay holds, first seen first."""
        return list(dict.fromkeys(f"{module or '(model)'}: {name}" for module, name, _ in self.intended))


def _is_bad(t, limit):
    if not t.is_floating_point() or not t.numel():
        return False
    with torch.no_grad():
        if not bool(torch.isfinite(t).all()):
            return True
        return t.dtype in HALF_DTYPES and bool(t.abs().amax() > limit)


def _all_finite(tensors):
    with torch.no_grad():
        return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point() and t.numel())


def _op_identity(func, entry):
    if entry is not None:
        return entry.target, entry.name, entry.category, f"{entry.path}:{entry.line}"
    name = getattr(func, "__name__", repr(func))
    if getattr(func, "__objclass__", None) is not None or getattr(func, "__self__", None) is None and \
            getattr(torch.Tensor, name, None) is func:
        target = "torch.Tensor"
    else:
        target = getattr(func, "__module__", None) or "torch"
        target = "torch" if target.startswith("torch._C") and hasattr(torch, name) else target
        target = "torch.nn.functional" if target == "torch.nn.functional" else target
    return target, name, "unlisted", "not in the op list (runs in its inputs' dtype)"


class _Watch(TorchFunctionMode):
    """Records origins of bad values (and registers gradient checks on half outputs)."""

    def __init__(self, limit, entries, modules, intended=None):
        super().__init__()
        self.limit, self.entries, self.modules = limit, entries, modules
        self.culprits, self.grad_culprits = [], []
        self.pending = {}  # id(cast output) -> (output, culprit): an overflowing cast, blamed on its consumer
        self.intended = intended  # the float32 replay's {(module, op, call number): [non-finite masks]}, or None
        self.seen = {}  # this replay's own non-finite outputs, keyed alike
        self.calls = {}  # (module, op) -> calls so far
        self.expected = {}  # id -> tensor: outputs whose non-finite values float32 holds too (finite to readers)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry = getattr(func, "_amp_patch_entry", None)
        call = func.__wrapped__ if entry is not None else func
        if getattr(func, "__name__", "") == "__get__":
            return func(*args, **kwargs)
        out = call(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            self._check(call, entry or self.entries.get(id(call)), args, kwargs, out)
        return out

    def _key(self, func, entry):
        module = self.modules[-1] if self.modules else ""
        pair = (module, entry.name if entry is not None else getattr(func, "__name__", repr(func)))
        self.calls[pair] = self.calls.get(pair, 0) + 1
        return (*pair, self.calls[pair])

    def _check(self, func, entry, args, kwargs, out):
        outs = [t for t in iter_tensors(out) if t.is_floating_point()]
        inputs = list(iter_tensors((args, kwargs)))
        key = self._key(func, entry)
        if self.pending and self._consumes_bad_cast(func, entry, inputs) or not outs:
            return
        bad = any(_is_bad(t, self.limit) for t in outs)
        if bad:
            self._note_nonfinite(key, outs)
        if bad and self._expected(key, outs):
            self.expected.update((id(t), t) for t in outs)
            bad = False
        if len(self.culprits) >= _MAX_EVENTS:
            return
        if bad and self._finite_inputs(inputs):
            if getattr(func, "__name__", "") in _CASTS and entry is None and len(outs) == 1:
                largest = max(float(t.detach().abs().amax()) for t in inputs if t.is_floating_point() and t.numel())
                self.pending[id(outs[0])] = (outs[0], self._culprit(func, entry, inputs, "output", largest))
            else:
                self.culprits.append(self._culprit(func, entry, inputs, "output", _float_max(func, args, kwargs)))
        elif any(t.dtype in HALF_DTYPES and t.requires_grad for t in outs):
            culprit = self._culprit(func, entry, inputs, "gradient", None)
            for t in outs:
                if t.requires_grad:
                    t.register_hook(self._grad_hook(culprit))

    def _note_nonfinite(self, key, outs):
        with torch.no_grad():
            self.seen[key] = [~torch.isfinite(t) for t in outs]

    def _expected(self, key, outs):
        """Whether every non-finite value of ``outs`` is one the float32 replay had at the same op (same place, or
        where the shapes differ, no more of them)."""
        masks = (self.intended or {}).get(key)
        if masks is None or len(masks) != len(outs):
            return False
        with torch.no_grad():
            for t, mask in zip(outs, masks):
                nonfinite = ~torch.isfinite(t)
                extra = bool((nonfinite & ~mask).any()) if nonfinite.shape == mask.shape else \
                    int(nonfinite.sum()) > int(mask.sum())
                if extra:
                    return False
        return True

    def _finite_inputs(self, inputs):
        return _all_finite([t for t in inputs if self.expected.get(id(t)) is not t])

    def _consumes_bad_cast(self, func, entry, inputs):
        """An op whose half argument overflowed when its wrapper cast it: the op (not the cast) is the culprit."""
        for t in inputs:
            hit = self.pending.pop(id(t), None)
            if hit is not None and hit[0] is t:
                culprit = self._culprit(func, entry, inputs, "input cast to half", hit[1].max_abs)
                self.culprits.append(dataclasses.replace(culprit, module=hit[1].module))
                return True
        return False

    def flush(self):
        """Overflowing casts no op consumed are culprits themselves."""
        self.culprits += [culprit for _, culprit in self.pending.values()]
        self.pending.clear()

    def _culprit(self, func, entry, inputs, where, max_abs):
        target, name, category, source = _op_identity(func, entry)
        module = self.modules[-1] if self.modules else ""
        return Culprit(module, target, name, category, source, where,
                       tuple(t.dtype for t in inputs if t.is_floating_point()), max_abs)

    def _grad_hook(self, culprit):
        def hook(grad):
            if len(self.grad_culprits) < _MAX_EVENTS and not bool(torch.isfinite(grad).all()):
                self.grad_culprits.append(dataclasses.replace(culprit, max_abs=float("inf")))
        return hook


def _float_max(func, args, kwargs):
    """The output's largest |value| when the op runs in float32 (the evidence that it does not fit in half)."""
    def up(t):
        return t.float() if t.dtype in HALF_DTYPES else t
    try:
        with torch.no_grad():
            out = func(*cast_tree(list(args), up), **cast_tree(dict(kwargs), up))
        values = [float(t.abs().amax()) for t in iter_tensors(out) if t.is_floating_point() and t.numel()]
        return max(values) if values else None
    except Exception:  # noqa: BLE001 - evidence only; the op ran fine in the replay itself
        return None


def _patched_entries():
    engine = _state.active_engine()
    if engine is None:
        return {}
    return {id(p.original): getattr(p.replacement, "_amp_patch_entry", None) for p in engine.patcher.patches}


def replay(job, state, batch, *, half_dtype, op_lists, precise=False, intended=None):
    """Forward + backward of ``batch`` from weights ``state``: under O1 with ``op_lists`` or, with
    ``precise``, in float32 without amp_patch (where only inf/NaN count as bad). ``intended``: a float32
    replay's ``Replay.intended``, the non-finite values that do not count as bad."""
    model = job.model_fn()
    model.load_state_dict(state)
    inputs, target = batch[:-1], batch[-1]
    if not precise:
        # the Python engine: the watch attributes each cast to the wrapper that made it (the hybrid engine leaves
        # matching ops to native autocast inside forwards, bitwise the same, where no wrapper sees the cast)
        frontend.initialize(model, opt_level="O1", half_dtype=half_dtype, op_lists=op_lists, verbosity=0,
                            cast_engine="python")
    try:
        limit = math.inf if precise else torch.finfo(half_dtype).max
        stack = []
        watch = _Watch(limit, _patched_entries(), stack, intended)
        names = {id(m): name for name, m in model.named_modules()}
        with running_modules(names, stack), watch:
            loss = job.loss_fn(model(*inputs), target)
            watch.flush()
            loss.float().backward()
        grads_finite = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    finally:
        if not precise:
            frontend.deinitialize()
    bad_inputs = [i for i, t in enumerate(inputs) if torch.is_tensor(t) and not _all_finite([t])]
    culprits = watch.culprits or watch.grad_culprits[:1]
    if precise:  # no op list ran: the category and list line say nothing here
        culprits = [dataclasses.replace(c, category="-", source="float32 replay without amp_patch")
                    for c in culprits]
    return Replay(float(loss.detach().float()), grads_finite, culprits, bad_inputs, watch.seen if precise else {})
