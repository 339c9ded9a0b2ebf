"""Under O2 and O3, ``nn.MultiheadAttention`` given a float mask made in fp32 inside the forward trains.

With ``need_weights=True`` (the default) torch computes the attention weights with one ``baddbmm`` of the mask and
the half query, and refused the fp32 mask ("Input dtypes must be the same"), as for any half model; native
autocast casts the mask there. amp_patch now does the same: the run equals, bitwise, the one whose forward makes
its mask in the activations' dtype (the fix users wrote by hand), for the attention mask and the padding mask,
passed by keyword or by position.
"""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import amp_patch


class Attention(nn.Module):
    def __init__(self, kind, positional, like_query):
        super().__init__()
        self.kind, self.positional, self.like_query = kind, positional, like_query
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 3)

    def forward(self, h):
        if self.kind == "attn_mask":
            mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1])
        else:
            mask = torch.zeros(h.shape[0], h.shape[1])
            mask[:, -1] = float("-inf")
        if self.like_query:
            mask = mask.to(h.dtype)
        if self.positional:
            args = (h, h, h, mask, True, None) if self.kind == "key_padding_mask" else (h, h, h, None, True, mask)
            out, _ = self.mha(*args)
        else:
            out, _ = self.mha(h, h, h, **{self.kind: mask})
        return self.out(out.mean(1))


def _train(level, kind, positional, like_query, steps=3):
    torch.manual_seed(0)
    model = Attention(kind, positional, like_query)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    h, y = torch.randn(2, 5, 16), torch.randint(0, 3, (2,))
    losses = []
    try:
        for _ in range(steps):
            opt.zero_grad()
            loss = F.cross_entropy(model(h).float(), y)
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()]
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("positional", [False, True], ids=["keyword", "positional"])
@pytest.mark.parametrize("kind", ["attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_float_mask_made_inside_forward_trains_as_one_made_in_the_half_dtype(level, kind, positional):
    losses, params = _train(level, kind, positional, like_query=False)
    ref_losses, ref_params = _train(level, kind, positional, like_query=True)
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(p, r) for p, r in zip(params, ref_params))
