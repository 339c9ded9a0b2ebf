"""Stand-in for Apex's ``scaled_upper_triang_masked_softmax_cuda`` extension (GPT's causal softmax):
``forward(inputs, scale)`` on ``[attn_batches, sq, sk]`` (element ``j > i`` of row ``i`` gets probability 0),
``backward(output_grads, softmax_results, scale)`` (see :mod:`amp_patch.legacy._fused_softmax`)."""
from ._fused_softmax import softmax, softmax_backward

__all__ = ["forward", "backward"]


def forward(inputs, scale):
    return softmax(inputs, scale, causal=True)


def backward(output_grads, softmax_results, scale):
    return softmax_backward(output_grads, softmax_results, scale)
