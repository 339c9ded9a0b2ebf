"""Stand-in for Apex's ``fused_layer_norm_cuda`` extension (Megatron-style code imports it by name:
``importlib.import_module("fused_layer_norm_cuda")``), on torch math.

The signatures are Apex's: ``forward_affine(input, normalized_shape, gamma, beta, eps) -> [output, mean, invvar]``,
``forward(input, normalized_shape, eps)``, ``backward_affine(dout, mean, invvar, input_or_output, normalized_shape,
gamma, beta, eps, memory_efficient=False) -> [grad_input, grad_gamma, grad_beta]``, ``backward(...)`` and the RMS
forms (``rms_forward_affine -> [output, invvar]``, ``rms_backward_affine -> [grad_input, grad_gamma]``, ...), and the
``*_mixed_dtypes`` forwards (output in gamma's dtype). As Apex's kernels: statistics in fp32 for half inputs
(``mean``/``invvar`` have one element per normalized row), outputs in the input's dtype, weight grads in the
weight's dtype; with ``memory_efficient`` the fourth backward argument is the forward's output (the normalized
values are recovered from it), else its input. (The ``memory_efficient`` argument may be left out, as older
Apex releases had no such argument.)
"""
import torch

__all__ = ["forward_affine", "forward", "backward_affine", "backward", "forward_affine_mixed_dtypes",
           "rms_forward_affine", "rms_forward", "rms_backward_affine", "rms_backward",
           "rms_forward_affine_mixed_dtypes"]


def _acc(t):
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _rows(t, normalized_shape):
    n2 = 1
    for n in normalized_shape:
        n2 *= int(n)
    return _acc(t).reshape(-1, n2)


def _stats(x, normalized_shape, eps, rms):
    rows = _rows(x, normalized_shape)
    mean = torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device) if rms else rows.mean(-1)
    centered = rows if rms else rows - mean[:, None]
    invvar = torch.rsqrt(centered.pow(2).mean(-1) + eps)
    return rows, mean, invvar


@torch.no_grad()
def _forward(x, normalized_shape, gamma, beta, eps, rms, out_dtype):
    rows, mean, invvar = _stats(x, normalized_shape, eps, rms)
    y = (rows - mean[:, None]) * invvar[:, None]
    if gamma is not None:
        y = y * _acc(gamma).reshape(1, -1)
    if beta is not None:
        y = y + _acc(beta).reshape(1, -1)
    return y.reshape(x.shape).to(out_dtype), mean, invvar


def forward_affine(input, normalized_shape, gamma, beta, epsilon):
    return list(_forward(input, normalized_shape, gamma, beta, epsilon, False, input.dtype))


def forward(input, normalized_shape, epsilon):
    return list(_forward(input, normalized_shape, None, None, epsilon, False, input.dtype))


def forward_affine_mixed_dtypes(input, normalized_shape, gamma, beta, epsilon):
    return list(_forward(input, normalized_shape, gamma, beta, epsilon, False, gamma.dtype))


def rms_forward_affine(input, normalized_shape, gamma, epsilon):
    out, _, invvar = _forward(input, normalized_shape, gamma, None, epsilon, True, input.dtype)
    return [out, invvar]


def rms_forward(input, normalized_shape, epsilon):
    out, _, invvar = _forward(input, normalized_shape, None, None, epsilon, True, input.dtype)
    return [out, invvar]


def rms_forward_affine_mixed_dtypes(input, normalized_shape, gamma, epsilon):
    out, _, invvar = _forward(input, normalized_shape, gamma, None, epsilon, True, gamma.dtype)
    return [out, invvar]


@torch.no_grad()
def _backward(dout, mean, invvar, saved, normalized_shape, gamma, beta, memory_efficient, rms):
    """(grad_input, grad_gamma, grad_beta) from the normalized values ``xhat`` of each row, in fp32."""
    rows = _rows(saved, normalized_shape)
    if memory_efficient:  # ``saved`` is the output: xhat = (y - beta) / gamma
        xhat = rows
        if beta is not None:
            xhat = xhat - _acc(beta).reshape(1, -1)
        if gamma is not None:
            xhat = xhat / _acc(gamma).reshape(1, -1)
    else:
        xhat = (rows if rms else rows - mean.float()[:, None]) * invvar.float()[:, None]
    dy = _rows(dout, normalized_shape)
    dxhat = dy * _acc(gamma).reshape(1, -1) if gamma is not None else dy
    projection = (dxhat * xhat).mean(-1, keepdim=True) * xhat
    grad_input = invvar.float()[:, None] * (dxhat - projection if rms else
                                            dxhat - dxhat.mean(-1, keepdim=True) - projection)
    grad_input = grad_input.reshape(saved.shape).to(saved.dtype)
    grad_gamma = (dy * xhat).sum(0).reshape(gamma.shape).to(gamma.dtype) if gamma is not None else None
    grad_beta = dy.sum(0).reshape(beta.shape).to(beta.dtype) if beta is not None else None
    return grad_input, grad_gamma, grad_beta


def backward_affine(dout, mean, invvar, input_or_output, normalized_shape, gamma, beta, epsilon,
                    memory_efficient=False):
    return list(_backward(dout, mean, invvar, input_or_output, normalized_shape, gamma, beta, memory_efficient,
                          False))


def backward(dout, mean, invvar, input_or_output, normalized_shape, epsilon, memory_efficient=False):
    return _backward(dout, mean, invvar, input_or_output, normalized_shape, None, None, memory_efficient, False)[0]


def rms_backward_affine(dout, invvar, input_or_output, normalized_shape, gamma, epsilon, memory_efficient=False):
    return list(_backward(dout, None, invvar, input_or_output, normalized_shape, gamma, None, memory_efficient,
                          True)[:2])


def rms_backward(dout, invvar, input_or_output, normalized_shape, epsilon, memory_efficient=False):
    return _backward(dout, None, invvar, input_or_output, normalized_shape, None, None, memory_efficient, True)[0]
