"""Casting wrappers: what runs in place of a patched torch entry point.

The hot path is built once per patch when the op list is applied: each wrapper
is a plain Python closure (dynamo traces those; it silently skips
``wrapt.FunctionWrapper``) with its caster bound as a local. Per call it does
one ``type()`` test per argument and a dtype test per tensor (the per-thread
switch is a truth test of a dict that is empty unless a ``disable_casts()`` region is open); the fp32 -> half
cast of a weight is served from the cast cache.
"""
import copy
import dataclasses
import functools
import threading

import torch

from .._torch.compat import tracing
from ..config.dtypes import FLOAT_DTYPES, HALF_DTYPES
from ..errors import BannedOpError, CastError
from .cache import CastCache, Tensor, make_to_half  # noqa: F401 - the cast cache and its caster (re-exported)
from .switch import DisabledThreads  # noqa: F401 - the engine's per-thread switch (re-exported)

_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_PLAIN_TYPES = frozenset((int, float, bool, complex, str, bytes, type(None), slice, type(Ellipsis), torch.dtype,
                          torch.device, torch.Size, torch.layout, torch.memory_format))
_promote_types = torch.promote_types


_thread_ident = threading.get_ident
_compiling = tracing


@torch.compiler.assume_constant_result
def _traced_ident():
    return _thread_ident()


def _ident_for_old_dynamo():
    """``threading.get_ident()`` that dynamo before torch 2.13 can trace (it broke the graph at every wrapper's
    ``if disabled and _get_ident() in disabled``): while compiling, the ident is a constant of the graph, as
    newer dynamo makes it."""
    return _traced_ident() if _compiling() else _thread_ident()


# the builtin where dynamo traces it (no extra call in eager); reached only while a region is open somewhere
_get_ident = _thread_ident if torch.torch_version.TorchVersion(torch.__version__) >= "2.13" else _ident_for_old_dynamo


def cast_tree(x, cast):
    """Apply ``cast`` to every tensor in ``x``, looking inside lists, tuples, dicts and dataclass instances.

    Containers keep their type: namedtuples, and dict subclasses such as HF's ModelOutput (copied, then
    updated), which Apex's O2 turned into plain dicts.
    """
    if isinstance(x, Tensor):
        return cast(x)
    if type(x) in _PLAIN_TYPES:
        return x
    if isinstance(x, (list, tuple)):
        items = [cast_tree(v, cast) for v in x]
        if hasattr(x, "_fields"):  # namedtuple
            return type(x)(*items)
        return type(x)(items) if type(x) in (list, tuple) else items
    if isinstance(x, dict):
        if type(x) is dict:
            return {k: cast_tree(v, cast) for k, v in x.items()}
        out = copy.copy(x)
        for k, v in x.items():
            out[k] = cast_tree(v, cast)
        return out
    if dataclasses.is_dataclass(x) and not isinstance(x, type):  # a model's output record
        return dataclasses.replace(x, **{f.name: cast_tree(getattr(x, f.name), cast)
                                         for f in dataclasses.fields(x) if f.init})
    return x


def iter_tensors(x):
    """Every tensor in ``x`` (looking inside lists, tuples and dicts), in order."""
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from iter_tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from iter_tensors(v)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from iter_tensors(getattr(x, f.name))


def any_caster(cast):
    """Extend a tensor caster to any argument: tensors cast, scalars as they are, containers searched."""

    def cast_any(a):
        cls = type(a)
        if cls in _TENSOR_TYPES:
            return cast(a)
        if cls in _PLAIN_TYPES:
            return a
        if cls is tuple or cls is list:  # conv's stride/padding/dilation: scalars only, kept as they are
            for v in a:
                if type(v) not in _PLAIN_TYPES:
                    return cast_tree(a, cast)
            return a
        return cast_tree(a, cast)

    return cast_any


def cast_args(cast, args):
    """Cast the tensors of a positional-argument tuple (fast path for plain tensors and scalars)."""
    return [cast(a) if type(a) in _TENSOR_TYPES else (a if type(a) in _PLAIN_TYPES else cast_tree(a, cast))
            for a in args]


def cast_kwargs(cast, kwargs):
    return {k: (cast(v) if type(v) in _TENSOR_TYPES else (v if type(v) in _PLAIN_TYPES else cast_tree(v, cast)))
            for k, v in kwargs.items()}


# ``t.half()`` / ``t.bfloat16()`` parse no arguments: measurably cheaper per call than ``t.to(dtype=...)``
_CAST_METHOD = {torch.float16: Tensor.half, torch.bfloat16: Tensor.bfloat16, torch.float32: Tensor.float,
                torch.float64: Tensor.double}


_float = Tensor.float


def to_float(t, _float=_float):
    """The caster for ``float`` ops: float16/bfloat16 -> float32."""
    if t.dtype in HALF_DTYPES:
        return _float(t)
    return t


@functools.lru_cache(maxsize=None)
def caster_to(dtype):
    """A caster that moves every floating tensor (other than ``dtype``) to ``dtype``."""

    method = _CAST_METHOD[dtype]

    def cast(t):
        dt = t.dtype
        if dt is dtype or dt not in FLOAT_DTYPES:
            return t
        return method(t)

    return cast


def widest_dtype(tensors):
    """The promoted floating dtype of ``tensors`` if they mix floating dtypes, else None."""
    found = None
    mixed = False
    for t in tensors:
        if isinstance(t, Tensor):
            dt = t.dtype
            if dt in FLOAT_DTYPES and dt is not found:
                if found is not None:
                    mixed = True
                    dt = _promote_types(found, dt)
                found = dt
    return found if mixed else None


def _finish(wrapper, original, entry):
    functools.update_wrapper(wrapper, original)
    wrapper.__wrapped__ = original
    wrapper._amp_patch_entry = entry
    return wrapper


def _casting_wrapper(original, entry, ctx, cast):
    """Wrapper that casts every tensor argument with ``cast`` (the ``half`` and ``float`` categories)."""
    disabled, cast_any, tensor_types, plain_types = ctx.disabled, any_caster(cast), _TENSOR_TYPES, _PLAIN_TYPES
    floating = cast is to_float  # (its test inline for 4 and more arguments: cross_entropy_loss's 6, every step)

    def wrapper(*args, **kwargs):
        if disabled and _get_ident() in disabled:
            return original(*args, **kwargs) if kwargs else original(*args)  # (no empty dict to merge: per call)
        if kwargs:
            if kwargs.get("out") is not None:  # torch.autocast registers no out= overload: it runs uncast
                return original(*args, **kwargs)
            return original(*map(cast_any, args), **cast_kwargs(cast, kwargs))
        n = len(args)  # unrolled for the common arities (no map/list), tensors cast without the dispatch hop
        if n == 3:
            a, b, c = args
            return original(cast(a) if type(a) in tensor_types else cast_any(a),
                            cast(b) if type(b) in tensor_types else cast_any(b),
                            cast(c) if type(c) in tensor_types else cast_any(c))
        if n == 2:
            a, b = args
            return original(cast(a) if type(a) in tensor_types else cast_any(a),
                            cast(b) if type(b) in tensor_types else cast_any(b))
        if n == 1:
            return original(cast_any(args[0]))
        cast_args = []  # (a loop, not a comprehension: one frame less; a call only per tensor not inline)
        for a in args:
            kind = type(a)
            if kind in plain_types:
                cast_args.append(a)
            elif kind in tensor_types:
                cast_args.append((_float(a) if a.dtype in HALF_DTYPES else a) if floating else cast(a))
            else:
                cast_args.append(cast_any(a))
        return original(*cast_args)

    return _finish(wrapper, original, entry)


def half_wrapper(original, entry, ctx):
    return _casting_wrapper(original, entry, ctx, ctx.to_half)


def float_wrapper(original, entry, ctx):
    return _casting_wrapper(original, entry, ctx, to_float)


def promote_wrapper(original, entry, ctx):
    disabled, plain_types = ctx.disabled, _PLAIN_TYPES

    def wrapper(*args, **kwargs):
        if disabled and _get_ident() in disabled:
            return original(*args, **kwargs) if kwargs else original(*args)  # (no empty dict to merge: per call)
        if len(args) == 2 and not kwargs:  # fast path: binary ops on two tensors of one dtype, or a scalar
            a, b = args
            dtype = getattr(b, "dtype", None)  # no exception raised and caught for a Python scalar
            if dtype is None:
                if type(b) in plain_types and (type(a) in plain_types or isinstance(a, Tensor)):
                    return original(a, b)  # a Python scalar never promotes a tensor's floating dtype
            elif getattr(a, "dtype", None) is dtype:
                return original(a, b)
        if kwargs and kwargs.get("out") is not None:  # as torch.autocast: out= overloads run uncast
            return original(*args, **kwargs)
        widest = widest_dtype(args + tuple(kwargs.values()) if kwargs else args)
        if widest is None:
            return original(*args, **kwargs)
        cast = caster_to(widest)
        args = [cast(a) if isinstance(a, Tensor) else a for a in args]
        if kwargs:
            kwargs = {k: cast(v) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        return original(*args, **kwargs)

    return _finish(wrapper, original, entry)


def sequence_promote_wrapper(original, entry, ctx):
    disabled = ctx.disabled

    def wrapper(*args, **kwargs):
        if disabled and _get_ident() in disabled or kwargs.get("out") is not None:  # out=: as torch.autocast
            return original(*args, **kwargs) if kwargs else original(*args)
        if args:
            seq, rest = args[0], args[1:]
        else:
            seq, rest = kwargs.pop("tensors", ()), ()
        widest = widest_dtype(seq) if isinstance(seq, (list, tuple)) else None
        if widest is not None:
            cast = caster_to(widest)
            seq = [cast(t) if isinstance(t, Tensor) else t for t in seq]
        return original(seq, *rest, **kwargs)

    return _finish(wrapper, original, entry)


def inplace_wrapper(original, entry, ctx):
    """In-place Tensor methods keep ``self``'s dtype: other args are cast to it."""
    disabled = ctx.disabled
    forbid_half_self = entry.category == "float"

    def wrapper(self, *args, **kwargs):
        if disabled and _get_ident() in disabled or not isinstance(self, Tensor):
            return original(self, *args, **kwargs) if kwargs else original(self, *args)
        dt = self.dtype
        if forbid_half_self and dt in HALF_DTYPES:
            raise CastError(f"{entry.qualname} is in the float list ({entry.path}:{entry.line}) but self is {dt}: "
                            "an in-place op cannot change self's dtype. Use the out-of-place form on a float32 "
                            f"tensor (x = x.float().{entry.name.rstrip('_')}(...)), or remove {entry.name} from "
                            "the op list's float category.")
        if dt not in FLOAT_DTYPES or not _needs_cast(dt, args, kwargs):
            return original(self, *args, **kwargs)  # the common case (e.g. optimizer math): nothing to cast
        cast = caster_to(dt)
        return original(self, *cast_args(cast, args), **cast_kwargs(cast, kwargs))

    return _finish(wrapper, original, entry)


def _needs_cast(dtype, args, kwargs):
    """Whether any argument is a floating tensor of another dtype (containers: assume yes)."""
    for a in (args + tuple(kwargs.values())) if kwargs else args:
        cls = type(a)
        if cls in _TENSOR_TYPES:
            if a.dtype is not dtype and a.dtype in FLOAT_DTYPES:
                return True
        elif cls not in _PLAIN_TYPES:
            return True
    return False


def banned_wrapper(original, entry, ctx):
    if ctx.allow_banned:
        return float_wrapper(original, entry, ctx)
    message = entry.message or ("{qualname} is banned under amp_patch. Pass allow_banned=True to run it in "
                                "float32, or remove it from the op list's banned category.")
    message = f"{message.replace('{qualname}', entry.qualname)} (banned by {entry.path}:{entry.line})"
    disabled, strict = ctx.disabled, entry.strict

    def wrapper(*args, **kwargs):
        if disabled and _get_ident() in disabled or not (strict or _has_half(args, kwargs)):
            return original(*args, **kwargs)  # banned only on half input (Apex): fp32 callers are fine
        raise BannedOpError(message)

    return _finish(wrapper, original, entry)


def _has_half(args, kwargs):
    return any(t.dtype in HALF_DTYPES for t in iter_tensors((args, kwargs)))


def is_inplace_name(name):
    if name.startswith("__") and name.endswith("__"):
        return name.startswith("__i") and name not in ("__invert__", "__index__", "__int__", "__init__")
    return name.endswith("_") and not name.startswith("_")


def fp8_wrapper(original, entry, ctx):
    """The ``fp8`` category (amp_patch.casting.fp8): a scaled float8 matmul, the ``half`` wrapper where it cannot."""
    from .fp8 import fp8_wrapper as build  # fp8 builds on this module's pieces
    return build(original, entry, ctx, _finish, half_wrapper)


FACTORIES = {
    "half": half_wrapper,
    "fp8": fp8_wrapper,
    "float": float_wrapper,
    "promote": promote_wrapper,
    "sequence_promote": sequence_promote_wrapper,
    "banned": banned_wrapper,
}


def make_wrapper(original, entry, ctx, *, method=False):
    """Build the wrapper for ``entry``. In-place ops (``Tensor.exp_``, and functions such as ``torch.exp_`` whose
    first argument is the tensor they write) get the dtype-keeping variant: a casting wrapper would run them on a
    cast copy and silently drop the result. (``method`` is kept for the callers' signature.)"""
    if entry.category != "banned" and is_inplace_name(entry.name):
        return inplace_wrapper(original, entry, ctx)
    return FACTORIES[entry.category](original, entry, ctx)


def cast_call_args(category, ctx, args, kwargs):
    """Cast ``args``/``kwargs`` the way a ``category`` wrapper of ``ctx`` would (for decorators; not the hot path)."""
    if category == "half":
        cast = ctx.to_half
    elif category == "float":
        cast = to_float
    else:
        widest = widest_dtype(tuple(args) + tuple(kwargs.values()))
        if widest is None:
            return args, kwargs
        cast = caster_to(widest)
    return cast_args(cast, args), cast_kwargs(cast, kwargs)
