"""Stand-in for Apex's ``syncbn`` extension: the batch-norm pieces ``apex.parallel``'s optimized SyncBatchNorm called.

Plain torch math on any device. As Apex's kernels did, statistics and reductions are computed in fp32 for half
inputs (``mean``/``inv_std``/``sum_dy``/``sum_dy_xmu`` are fp32 then), elementwise results come back in the
input's dtype, and ``weight``/``bias`` may be the input's dtype or fp32 (``grad_weight``/``grad_bias`` take the
weight's dtype; without a weight they are empty, as Apex returned them). NCHW functions reduce over every dim
but dim 1; the ``_c_last`` ones take channels in the last dim. ``count`` is a tensor of per-rank element counts
(their sum divides ``sum_dy``/``sum_dy_xmu``).
"""
import torch

__all__ = ["welford_mean_var", "welford_parallel", "batchnorm_forward", "reduce_bn", "batchnorm_backward",
           "welford_mean_var_c_last", "batchnorm_forward_c_last", "reduce_bn_c_last", "batchnorm_backward_c_last",
           "relu_bw_c_last"]


def _acc_dtype(tensor):
    return torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype


def _acc(tensor):
    return tensor.to(_acc_dtype(tensor))


def _as_rows(tensor):
    """(M, C) view of an NCHW tensor's data: channel last, everything else flattened."""
    return tensor.movedim(1, -1).reshape(-1, tensor.shape[1])


def _from_rows(rows, like):
    shape = (like.shape[0],) + tuple(like.shape[2:]) + (like.shape[1],)
    return rows.reshape(shape).movedim(-1, 1)


def _rows_c_last(tensor):
    return tensor.reshape(-1, tensor.shape[-1])


def _mean_var(rows):
    x = _acc(rows)
    return x.mean(0), x.var(0, unbiased=False)


def welford_mean_var(input):
    """(mean, biased variance) per channel (dim 1), in fp32 for half input."""
    return _mean_var(_as_rows(input))


def welford_mean_var_c_last(input):
    """(mean, biased variance) per channel (last dim), in fp32 for half input."""
    return _mean_var(_rows_c_last(input))


def welford_parallel(mean, var_biased, count, eps):
    """Combines per-rank ``mean``/``var_biased`` (``[world, C]``) with ``count`` (``[world]``) elements each:
    returns (mean, unbiased variance, inv_std) over all ranks, in ``var_biased``'s dtype."""
    dtype = var_biased.dtype
    n = count.to(torch.float64).reshape(-1, 1)
    m, v = mean.to(torch.float64), var_biased.to(torch.float64)
    total = n.sum()
    mean_all = (m * n).sum(0) / total
    m2 = (v * n + n * (m - mean_all) ** 2).sum(0)
    var_unbiased = m2 / (total - 1)
    inv_std = 1.0 / torch.sqrt(m2 / total + eps)
    return mean_all.to(dtype), var_unbiased.to(dtype), inv_std.to(dtype)


def _affine(rows, mean, inv_std, weight, bias):
    out = (_acc(rows) - mean) * inv_std
    if weight is not None:
        out = out * weight.to(out.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def batchnorm_forward(input, mean, inv_std, weight, bias):
    """``(input - mean) * inv_std * weight + bias`` per channel (dim 1), in the input's dtype."""
    out = _affine(_as_rows(input), mean, inv_std, weight, bias)
    return _from_rows(out.to(input.dtype), input).contiguous()


def batchnorm_forward_c_last(input, z, mean, inv_std, weight, bias, fuse_relu):
    """Channel-last forward; adds ``z`` (when given) and applies a ReLU when ``fuse_relu``."""
    out = _affine(_rows_c_last(input), mean, inv_std, weight, bias)
    if z is not None:
        out = out + _rows_c_last(z).to(out.dtype)
    if fuse_relu:
        out = torch.relu(out)
    return out.to(input.dtype).reshape(input.shape)


def relu_bw_c_last(grad_output, input, z, mean, inv_std, weight, bias):
    """``grad_output`` where the fused forward's pre-ReLU value is positive, else 0."""
    pre = _affine(_rows_c_last(input), mean, inv_std, weight, bias)
    if z is not None:
        pre = pre + _rows_c_last(z).to(pre.dtype)
    keep = (pre > 0).reshape(input.shape)
    return torch.where(keep, grad_output, torch.zeros((), dtype=grad_output.dtype, device=grad_output.device))


def _reduce(dy_rows, x_rows, mean, inv_std, weight):
    dy = _acc(dy_rows)
    xmu = _acc(x_rows) - mean
    sum_dy = dy.sum(0).to(mean.dtype)
    sum_dy_xmu = (dy * xmu).sum(0).to(mean.dtype)
    if weight is None:
        empty = torch.empty(0, dtype=mean.dtype, device=mean.device)
        return sum_dy, sum_dy_xmu, empty, empty.clone()
    grad_weight = (sum_dy_xmu * inv_std).to(weight.dtype)
    return sum_dy, sum_dy_xmu, grad_weight, sum_dy.to(weight.dtype)


def reduce_bn(grad_output, input, mean, inv_std, weight):
    """(sum_dy, sum_dy_xmu, grad_weight, grad_bias) per channel (dim 1)."""
    return _reduce(_as_rows(grad_output), _as_rows(input), mean, inv_std, weight)


def reduce_bn_c_last(grad_output, input, mean, inv_std, weight):
    """(sum_dy, sum_dy_xmu, grad_weight, grad_bias) per channel (last dim)."""
    return _reduce(_rows_c_last(grad_output), _rows_c_last(input), mean, inv_std, weight)


def _grad_input(dy_rows, x_rows, mean, inv_std, weight, sum_dy, sum_dy_xmu, count):
    total = count.to(torch.int64).sum().to(mean.dtype)
    scale = inv_std if weight is None else inv_std * weight.to(inv_std.dtype)
    factor = inv_std * inv_std * sum_dy_xmu / total
    return (_acc(dy_rows) - sum_dy / total - (_acc(x_rows) - mean) * factor) * scale


def batchnorm_backward(grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count):
    """grad_input per channel (dim 1), in the input's dtype; ``count`` holds each rank's element count."""
    rows = _grad_input(_as_rows(grad_output), _as_rows(input), mean, inv_std, weight, sum_dy, sum_dy_xmu, count)
    return _from_rows(rows.to(input.dtype), input).contiguous()


def batchnorm_backward_c_last(grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count):
    """grad_input for channel-last tensors, in the input's dtype."""
    rows = _grad_input(_rows_c_last(grad_output), _rows_c_last(input), mean, inv_std, weight, sum_dy,
                       sum_dy_xmu, count)
    return rows.to(input.dtype).reshape(input.shape)
