"""Float8 numerics of the ``fp8`` category: dynamic scales, quantization and the scaled matmul with its backward.

The recipes are torchao 0.18's (``torchao.float8``, ``Float8LinearConfig.from_recipe_name``), reproduced op for op
so that an fp8 op list gives the bits ``convert_to_float8_training`` gives:

- ``tensorwise``: one fp32 scale per tensor, ``finfo(fp8).max / max(|x|)`` (computed in float64); operands in
  ``float8_e4m3fn``, the output gradient in ``float8_e5m2``.
- ``rowwise``: one scale per row of each operand along the matmul's inner dimension, rounded down to a power of 2;
  ``float8_e4m3fn`` for operands and gradient.

Every op here is an ``aten`` op called through ``torch.ops.aten``: no op-list wrapper (or a user's patch of a torch
name) can reach inside, and dynamo traces them as they are. Nothing here imports torchao.
"""
import torch

_aten = torch.ops.aten
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
_EPS = 1e-12  # torchao's floor on amax (no division by zero for an all-zero tensor)
#: (operand dtype, gradient dtype, power-of-2 scales) per recipe
RECIPES = {"tensorwise": (E4M3, E5M2, False), "rowwise": (E4M3, E4M3, True)}


def scale_of(t, fp8_dtype, dim=None, pow2=False):
    """The multiplicative scale that maps ``t`` onto ``fp8_dtype``'s range (torchao's ``tensor_to_scale``):
    fp32, 0-dim for ``dim=None`` (tensorwise), else keepdim amax along ``dim``."""
    magnitude = _aten.abs.default(t)
    amax = _aten.max.default(magnitude) if dim is None else _aten.amax.default(magnitude, [dim], True)
    amax = _aten._to_copy.default(amax, dtype=torch.float64)
    amax = _aten.clamp.default(amax, _EPS)
    scale = _aten.mul.Tensor(_aten.reciprocal.default(amax), _MAX[fp8_dtype])
    scale = _aten._to_copy.default(scale, dtype=torch.float32)
    if pow2:
        scale = _aten.exp2.default(_aten.floor.default(_aten.log2.default(scale)))
    return scale


def quantize(t, fp8_dtype, dim=None, pow2=False):
    """``(data, scale)``: ``t`` scaled and saturated into ``fp8_dtype`` (torchao's ``_ToFloat8ConstrFunc``)."""
    scale = scale_of(t, fp8_dtype, dim, pow2)
    scaled = _aten.mul.Tensor(_aten._to_copy.default(t, dtype=torch.float32), scale)
    top = _MAX[fp8_dtype]
    data = _aten._to_copy.default(_aten.clamp.default(scaled, -top, top), dtype=fp8_dtype)
    return data, scale


def quantize_weight(b, recipe):
    """The right operand ``b`` (``[K, N]``) as the forward and the input-gradient matmuls read it:
    ``(fwd_data, fwd_scale, bwd_data, bwd_scale)`` (tensorwise: one quantization serves both, and the last two
    are None: dynamo refuses one tensor passed twice to an autograd.Function)."""
    operand, _, pow2 = RECIPES[recipe]
    if recipe == "tensorwise":
        return quantize(b, operand) + (None, None)
    fwd = quantize(b, operand, 0, pow2)  # one scale per output column: [1, N]
    bwd = quantize(b, operand, -1, pow2)  # one scale per inner row, read transposed by grad_input: [K, 1]
    return fwd + bwd


def _is_row_major(t):
    return t.stride(0) > t.stride(1) and t.stride(1) == 1


def _row_major(t):
    """torchao's layout rule for the left operand: row-major, else a contiguous copy."""
    return t if _is_row_major(t) else _aten.clone.default(t, memory_format=torch.contiguous_format)


def _col_major(t):
    """... and for the right one: a row-major operand is copied column-major."""
    if not _is_row_major(t):
        return t
    return _aten.t.default(_aten.clone.default(_aten.t.default(t), memory_format=torch.contiguous_format))


def scaled_mm(a, a_scale, b, b_scale, out_dtype, fast_accum):
    """``a @ b`` of two quantized operands in ``out_dtype`` (torchao's ``addmm_float8_unwrapped``: inverse scales;
    rowwise without fast accumulation scales the output afterwards; rowwise fp16/fp32 outputs go through bf16)."""
    a, b = _row_major(a), _col_major(b)
    a_inv, b_inv = _aten.reciprocal.default(a_scale), _aten.reciprocal.default(b_scale)
    rowwise = a_scale.dim() == 2
    post = None
    if rowwise and not fast_accum:
        post = _aten.mul.Tensor(a_inv, b_inv)
        a_inv = b_inv = _aten.new_ones.default(a_inv, ())
    dtype = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
    out = _aten._scaled_mm.default(a, b, a_inv, b_inv, None, None, dtype, fast_accum)
    if post is not None:
        out = _aten.mul_.Tensor(out, post)
    return out if dtype is out_dtype else _aten._to_copy.default(out, dtype=out_dtype)


class ScaledMatmul(torch.autograd.Function):
    """``a @ b`` in float8 with torchao's backward. ``a``: ``[M, K]`` (quantized here); ``b``: ``[K, N]``, whose
    quantized forms (``quantize_weight``) come from the caller (the cast cache serves a weight's).

    Returns ``out_dtype``. The input gradient is ``grad @ b.T``, the weight gradient ``a.T @ grad``, both scaled
    matmuls in the gradient's dtype, as torchao computes them.
    """

    @staticmethod
    def forward(ctx, a, b, b_data, b_scale, bt_data, bt_scale, recipe, out_dtype):
        operand, _, pow2 = RECIPES[recipe]
        a_data, a_scale = quantize(a, operand, None if recipe == "tensorwise" else -1, pow2)
        if bt_data is None:
            bt_data, bt_scale = b_data, b_scale
        if recipe == "tensorwise":  # the backward's quantization of ``a`` is this one: keep 1 byte per element
            ctx.save_for_backward(a_data, a_scale, bt_data, bt_scale)
        else:
            ctx.save_for_backward(a, None, bt_data, bt_scale)
        ctx.recipe = recipe
        return scaled_mm(a_data, a_scale, b_data, b_scale, out_dtype, True)

    @staticmethod
    def backward(ctx, grad):
        saved_a, a_scale, bt_data, bt_scale = ctx.saved_tensors
        _, grad_dtype, pow2 = RECIPES[ctx.recipe]
        tensorwise = ctx.recipe == "tensorwise"
        grad_a = grad_b = None
        if tensorwise:
            g_data, g_scale = quantize(grad, grad_dtype)
        if ctx.needs_input_grad[0]:
            if not tensorwise:
                g_data, g_scale = quantize(grad, grad_dtype, -1, pow2)
            grad_a = scaled_mm(g_data, g_scale, _aten.t.default(bt_data), _aten.t.default(bt_scale), grad.dtype,
                               False)
        if ctx.needs_input_grad[1]:
            if tensorwise:
                a_data, gw_data, gw_scale = saved_a, g_data, g_scale
            else:
                gw_data, gw_scale = quantize(grad, grad_dtype, 0, pow2)
                a_data, a_scale = quantize(saved_a, RECIPES[ctx.recipe][0], 0, pow2)
            grad_b = scaled_mm(_aten.t.default(gw_data), _aten.t.default(gw_scale), a_data, a_scale, grad.dtype,
                               False)
            grad_b = _aten.t.default(grad_b)
        return grad_a, grad_b, None, None, None, None, None, None
