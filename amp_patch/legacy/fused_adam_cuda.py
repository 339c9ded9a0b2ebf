"""Stand-in for Apex's ``fused_adam_cuda`` extension (``--deprecated_fused_adam``; the FusedAdam that fairseq,
pytorch-pretrained-BERT and OpenNMT-py 3.x copied), on torch math.

``adam(p, p_copy, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay)`` updates ``p``,
``m``, ``v`` in place as Apex's kernel did, in the dtype of ``p`` (half grads need fp32 ``p``, ``m``, ``v``; other
grads need all four in their dtype; Apex's kernel raised otherwise, and so does this): ``g / grad_scale`` into
the moments, ``mode`` 0 puts ``eps`` under the square root, 1 outside, the update is ``m / denom + decay * p``
times ``lr * sqrt(1 - beta2^step) / (1 - beta1^step)`` (just ``lr`` without ``bias_correction``), and ``p_copy``
(unless empty, and only for half grads, as in Apex) gets the new ``p`` in its own dtype (the half model
weight). ``adam_mt`` is the multi-tensor form
(``[p, m, v, g]`` or ``[p, m, v, g, p_copy]``); ``maybe_adam_undo`` reverts a step where ``overflow_flag`` is set;
``strided_check_finite`` sets the flag on inf/NaN; ``maybe_cast`` copies unless the flag is set.
"""
import math

import torch

__all__ = ["adam", "reversible_adam", "adam_mt", "maybe_adam_undo", "strided_check_finite", "maybe_cast",
           "maybe_cast_mt"]


def _step_size(lr, beta1, beta2, step, bias_correction):
    if bias_correction == 1:
        return lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
    return lr


def _denom(v, eps, mode):
    return (v + eps).sqrt() if mode == 0 else v.sqrt().add_(eps)


@torch.no_grad()
def adam(p, p_copy, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay):
    """One Adam step on one tensor (see the module docstring); returns None, as the extension did."""
    half_grad = g.dtype is torch.float16
    if half_grad and p.dtype is not torch.float32:
        raise RuntimeError("expected parameter to be of float type")  # (Apex's kernel: half grads, fp32 params)
    if not half_grad and not p.dtype == m.dtype == v.dtype == g.dtype:
        raise RuntimeError(f"expected p, m, v and g of one dtype for {g.dtype} grads; got {p.dtype}, {m.dtype}, "
                           f"{v.dtype}")
    step_size = _step_size(lr, beta1, beta2, step, bias_correction)
    scaled = g.to(p.dtype) / grad_scale
    m.mul_(beta1).add_(scaled, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(scaled, scaled, value=1 - beta2)
    update = m / _denom(v, eps, mode) + decay * p
    p.sub_(step_size * update)
    if half_grad and p_copy is not None and p_copy.numel() > 0:  # (fp32 grads: Apex wrote no copy)
        p_copy.copy_(p)


reversible_adam = adam  # (Apex's reversible variant differs in fp32 rounding of the same update only)


def adam_mt(chunk_size, overflow_flag, tensor_lists, lr, beta1, beta2, eps, grad_scale, step, mode,
            bias_correction, decay):
    """``adam`` over ``[params, exp_avgs, exp_avg_sqs, grads]`` (and ``p_copies``); ``chunk_size`` is ignored."""
    if len(tensor_lists) not in (4, 5):
        raise RuntimeError(f"expected tensor lists of size 4 or 5, got {len(tensor_lists)}")
    copies = tensor_lists[4] if len(tensor_lists) == 5 else [None] * len(tensor_lists[0])
    for p, m, v, g, p_copy in zip(*tensor_lists[:4], copies):
        adam(p, p_copy, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay)


@torch.no_grad()
def maybe_adam_undo(overflow_flag, p, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction,
                    decay):
    """Where ``overflow_flag`` is set, undo the ``adam`` step that ``g`` made (elements whose scaled grad is finite,
    as Apex's kernel); a no-op otherwise."""
    if overflow_flag is not None and int(overflow_flag.item()) == 0:
        return
    step_size = _step_size(lr, beta1, beta2, step, bias_correction)
    scaled = g.to(p.dtype) / grad_scale
    finite = torch.isfinite(scaled)
    scaled = torch.where(finite, scaled, torch.zeros_like(scaled))
    new_p = (p + step_size * (m / _denom(v, eps, mode))) / (1.0 - step_size * decay)
    new_m = (m - (1 - beta1) * scaled) / beta1
    new_v = ((v - (1 - beta2) * scaled * scaled) / beta2).clamp_(min=0.0)
    p.copy_(torch.where(finite, new_p, p))
    m.copy_(torch.where(finite, new_m, m))
    v.copy_(torch.where(finite, new_v, v))


@torch.no_grad()
def strided_check_finite(overflow_flag, p_copy, stride, clear_overflow_first):
    """Set ``overflow_flag`` to 1 if an element ``p_copy[::stride]`` is inf/NaN (cleared first on request)."""
    if clear_overflow_first:
        overflow_flag.zero_()
    values = p_copy.reshape(-1)[::stride]
    if values.is_floating_point():
        overflow_flag.masked_fill_(~torch.isfinite(values).all().to(overflow_flag.device), 1)


@torch.no_grad()
def maybe_cast(overflow_flag, p_in, p_out):
    """``p_out.copy_(p_in)`` unless ``overflow_flag`` is set."""
    if overflow_flag is None or int(overflow_flag.item()) == 0:
        p_out.copy_(p_in.reshape(p_out.shape))


def maybe_cast_mt(chunk_size, overflow_flag, tensor_lists):
    """``maybe_cast`` over ``[inputs, outputs]``."""
    for p_in, p_out in zip(*tensor_lists):
        maybe_cast(overflow_flag, p_in, p_out)
