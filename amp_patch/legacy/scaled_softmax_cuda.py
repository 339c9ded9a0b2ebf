"""Stand-in for Apex's ``scaled_softmax_cuda`` extension: ``forward(inputs, scale)``, ``backward(output_grads,
softmax_results, scale)`` (see :mod:`amp_patch.legacy._fused_softmax`)."""
from ._fused_softmax import softmax, softmax_backward

__all__ = ["forward", "backward"]


def forward(inputs, scale):
    return softmax(inputs, scale)


def backward(output_grads, softmax_results, scale):
    return softmax_backward(output_grads, softmax_results, scale)
