"""The ``fp8`` category's wrapper: a matmul in float8 through ``torch._scaled_mm``, returning the half dtype.

An fp8 op (``linear``, ``mm``, ``matmul``: :data:`amp_patch.config.fp8.FP8_OPS`) maps its arguments onto one 2-D
matmul ``a [M, K] @ b [K, N]`` (``linear``: ``b = weight.T``, then ``+ bias`` in the half dtype), quantizes its
floating operands as they come (fp32 or half) with dynamic scales (the table's ``fp8_recipe``: see
:mod:`amp_patch.casting.fp8_numerics`) and calls the scaled matmul through a ``torch.autograd.Function``.
A weight (a parameter as ``b``, or ``linear``'s weight) is quantized once per forward of a session's model (or per
``amp_patch.autocast()`` region) through the engine's cast cache, under the rules half casts follow there.

Where the scaled matmul cannot take the shapes (``M``, ``K`` or ``N`` not a multiple of 16: CUDA's kernels need
that, and the rule holds on every device so that CPU numerics predict the GPU's), where an argument is fp64 or not
floating, or the form is not a 2-D matmul (batched ``matmul``), the op runs as a ``half`` op would. The wrapper is a
plain closure (dynamo traces it); its recording variant (``amp_patch.trace()``) reports each call as fp8, with its
scales, or as a half fallback.
"""
import threading

import torch

from .._torch.compat import tracing
from ..config.fp8 import FP8_OPS
from .fp8_numerics import ScaledMatmul, quantize_weight

Tensor = torch.Tensor
Parameter = torch.nn.Parameter
ALIGN = 16  # the scaled matmul's size rule (CUDA): every dimension a multiple of 16
_QUANTIZABLE = frozenset((torch.float32, torch.float16, torch.bfloat16))
_TENSOR_TYPES = frozenset((Tensor, Parameter))
_get_ident = threading.get_ident
_compiling = tracing
_tracing = torch._C._is_tracing
_no_grad = torch.no_grad
_mode_enabled = torch._C._is_torch_function_mode_enabled
_handle = torch.overrides.handle_torch_function


def make_weight_quantizer(cache, recipe):
    """``quantized(b, param, transposed)``: :func:`quantize_weight` of ``b`` (``param`` itself, or its transpose),
    served from ``cache`` in a region for a parameter leaf, as ``make_to_half`` serves half casts."""
    entries, forwards, regions = cache.entries, cache.forwards, cache.regions

    def quantized(b, param, transposed):
        with _no_grad():
            if param is None or _compiling() or _tracing() or not (param.requires_grad and param.is_leaf):
                return quantize_weight(b, recipe)
            ident = _get_ident()
            if ident not in forwards and ident not in regions:
                return quantize_weight(b, recipe)
            key = (id(param), "fp8", recipe, transposed)  # an fp8 entry never shares a key with a half cast
            hit = entries.get(key)
            if hit is not None and hit[0] is param and hit[1] == param._version:
                return hit[3]
            out = quantize_weight(b, recipe)
            entries[key] = (param, param._version, True, out)
            return out

    return quantized


def _aligned(*sizes):
    for size in sizes:
        if size % ALIGN or size == 0:
            return False
    return True


def _operands(kind, args, kwargs):
    """``(a2d, b, param, transposed, bias, lead)`` for a call the scaled matmul can take, else None."""
    if kind == "linear":
        x = args[0] if args else kwargs.get("input")
        w = args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if type(w) not in _TENSOR_TYPES or w.dim() != 2:
            return None
        b, param, transposed = w.t(), w if type(w) is Parameter else None, True
    else:
        if len(args) != 2 or kwargs:
            return None
        x, b = args if kind != "rmatmul" else (args[1], args[0])
        bias, param, transposed = None, b if type(b) is Parameter else None, False
        if kind == "mm" and type(x) in _TENSOR_TYPES and x.dim() != 2:
            return None
    if type(x) not in _TENSOR_TYPES or type(b) not in _TENSOR_TYPES or x.dim() < 2 or b.dim() != 2:
        return None
    if bias is not None and (type(bias) not in _TENSOR_TYPES or bias.dtype not in _QUANTIZABLE):
        return None
    if x.dtype not in _QUANTIZABLE or b.dtype not in _QUANTIZABLE or x.shape[-1] != b.shape[0]:
        return None
    lead = x.shape[:-1]
    a = x.reshape(-1, x.shape[-1])
    if not _aligned(a.shape[0], b.shape[0], b.shape[1]):
        return None
    return a, b, param, transposed, bias, lead


def fp8_wrapper(original, entry, ctx, finish, half_fallback):
    """The wrapper of an ``fp8`` entry. ``ctx``: the engine (or the tracer's context: then ``ctx.fp8_record``
    hears of each call); ``finish``/``half_fallback``: ``wrappers._finish`` and the ``half`` wrapper of this op."""
    kind = FP8_OPS[entry.name]
    disabled, get_ident = ctx.disabled, _get_ident
    recipe, half, to_half = ctx.fp8_recipe, ctx.half_dtype, ctx.to_half
    quantized = make_weight_quantizer(ctx.cache, recipe)
    fallback = half_fallback(original, entry, ctx)
    record = getattr(ctx, "fp8_record", None)
    apply = ScaledMatmul.apply

    def compute(a, b, param, transposed, bias, lead):
        qb = quantized(b, param, transposed)
        out = apply(a, b, *qb, recipe, half)
        out = out.reshape(*lead, b.shape[1])
        return out if bias is None else torch.ops.aten.add.Tensor(out, to_half(bias))

    def as_one_call(*found):  # what a torch-function mode (the doctor's watch, the trace) sees: the fp8 op, whole
        return compute(*found)

    as_one_call._amp_patch_entry, as_one_call.__wrapped__ = entry, compute
    as_one_call.__name__ = f"{entry.name}_fp8"

    def run(found):
        if not _compiling() and _mode_enabled():
            return _handle(as_one_call, (found[0], found[1]), *found)
        return compute(*found)

    if record is None:
        def wrapper(*args, **kwargs):
            if disabled and get_ident() in disabled or kwargs and kwargs.get("out") is not None:
                return original(*args, **kwargs)
            found = _operands(kind, args, kwargs)
            return fallback(*args, **kwargs) if found is None else run(found)
    else:
        def wrapper(*args, **kwargs):
            if disabled and get_ident() in disabled or kwargs and kwargs.get("out") is not None:
                return original(*args, **kwargs)
            found = _operands(kind, args, kwargs)
            if found is None:
                record(None, None)
                return fallback(*args, **kwargs)
            record(found[0], quantized(found[1], found[2], found[3]), recipe)
            return run(found)

    return finish(wrapper, original, entry)
