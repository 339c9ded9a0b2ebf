"""The torch math behind the stand-ins for Apex's Megatron softmax extensions (``scaled_softmax_cuda``,
``scaled_masked_softmax_cuda``, ``generic_scaled_masked_softmax_cuda``, ``scaled_upper_triang_masked_softmax_cuda``):
``softmax(scale * x)`` over the last dim, in fp32, returned in the input's dtype, with Apex's masks (a masked
element is set to -10000 before the softmax, a row masked throughout is
all zeros; the upper triangle of a causal mask is left out: probability 0);
``backward(output_grads, softmax_results, scale)`` is ``scale * y * (g - sum(g * y))``."""
import torch


@torch.no_grad()
def softmax(inputs, scale, mask=None, causal=False):
    x = inputs.float() * scale
    if mask is not None:  # (a row masked throughout comes out all zeros, as Apex's kernel gave it)
        mask = mask.bool()
        x = x.masked_fill(mask, -10000.0)
    if causal:
        sq, sk = x.shape[-2], x.shape[-1]
        upper = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
        x = x.masked_fill(upper, float("-inf"))
    y = torch.softmax(x, dim=-1)
    if mask is not None:
        y = y.masked_fill(mask.expand_as(y).all(-1, keepdim=True), 0.0)
    return y.to(inputs.dtype)


@torch.no_grad()
def softmax_backward(output_grads, softmax_results, scale):
    g, y = output_grads.float(), softmax_results.float()
    return (scale * y * (g - (g * y).sum(-1, keepdim=True))).to(output_grads.dtype)


def batch_per_block(query_seq_len, key_seq_len, batches, attn_heads):
    """Apex's ``get_batch_per_block``: rows one CUDA block handled (Megatron checks ``batches % it == 0``)."""
    power = 1
    while power < key_seq_len:
        power *= 2
    warp_size = min(power, 32)
    return (128 // warp_size) * (2 if power <= 128 else 1)
