"""Stand-in for Apex's ``xentropy_cuda`` extension (``apex.contrib.xentropy``; Composer, Lightning Thunder and
OpenFold-style code import it by name), on torch math.

``forward(logits, labels, smoothing, half_to_float) -> [losses, max_log_sum_exp]``: per row, ``losses`` (fp32) is
``(1 - smoothing) * (lse - x[label]) + smoothing * (lse - mean(x))`` with ``lse`` the row's log-sum-exp (returned
as ``max_log_sum_exp``: fp32 with ``half_to_float``, else the logits' dtype). ``backward(grad_loss, logits,
max_log_sum_exp, labels, smoothing)`` returns ``grad_loss * (softmax(x) - (1 - smoothing) * onehot - smoothing /
classes)`` in the logits' dtype. Computed in fp32, as Apex's kernel accumulated.
"""
import torch

__all__ = ["forward", "backward", "__version__"]
__version__ = ""  # (Apex's extension exported its XENTROPY_VER, empty unless set at build time)


@torch.no_grad()
def forward(logits, labels, smoothing, half_to_float):
    if half_to_float and logits.dtype is not torch.float16:
        raise RuntimeError("conversion is supported for Half type only")
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    losses = (lse - x.mean(-1)) * smoothing - (picked - lse) * (1 - smoothing)
    return [losses, lse if half_to_float else lse.to(logits.dtype)]


@torch.no_grad()
def backward(grad_loss, logits, max_log_sum_exp, labels, smoothing):
    x = logits.float()
    probs = torch.exp(x - max_log_sum_exp.float().unsqueeze(-1))
    onehot = torch.zeros_like(x).scatter_(-1, labels.long().unsqueeze(-1), 1.0)
    grad = grad_loss.float().unsqueeze(-1) * (probs - onehot * (1 - smoothing) - smoothing / x.shape[-1])
    return grad.to(logits.dtype)
