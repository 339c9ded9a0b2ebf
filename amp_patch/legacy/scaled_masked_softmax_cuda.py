"""Stand-in for Apex's ``scaled_masked_softmax_cuda`` extension: ``forward(inputs, mask, scale)`` (``mask`` true
where an element is left out: -10000 before the softmax), ``backward(output_grads, softmax_results, scale)``,
``get_batch_per_block(query_seq_len, key_seq_len, batches, attn_heads)`` (see
:mod:`amp_patch.legacy._fused_softmax`)."""
from ._fused_softmax import batch_per_block as get_batch_per_block
from ._fused_softmax import softmax, softmax_backward

__all__ = ["forward", "backward", "get_batch_per_block"]


def forward(inputs, mask, scale):
    return softmax(inputs, scale, mask=mask)


def backward(output_grads, softmax_results, scale):
    return softmax_backward(output_grads, softmax_results, scale)
