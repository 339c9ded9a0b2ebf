"""``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)`` under O2 train as in fp32. Torch cannot carry a
sparse grad back through a half compute copy (``to()``'s backward refuses the layout change), so a sparse
embedding keeps its fp32 weight, as a kept-fp32 module does, and its output is cast to the half dtype: the same
values as a lookup in the half-rounded weight (rounding commutes with the gather)."""
import pytest
import torch

import amp_patch


class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(10, 8, sparse=True, mode="sum")
        self.out = torch.nn.Linear(8, 4)

    def forward(self, idx):
        return self.out(self.emb(idx, torch.arange(0, idx.numel(), 2), per_sample_weights=torch.rand(idx.numel())))


def _net(kind):
    torch.manual_seed(0)
    if kind == "bag":
        return Bag()
    return torch.nn.Sequential(torch.nn.Embedding(10, 8, sparse=True), torch.nn.Linear(8, 4))


def _run(kind, opt_class, amp=None, steps=4):
    model = _net(kind)
    groups = [{"params": [p for p in model.parameters() if p.dim() == 2 and p.shape[0] == 10]},
              {"params": [p for p in model.parameters() if not (p.dim() == 2 and p.shape[0] == 10)]}]
    opts = [opt_class(groups[0]["params"], lr=0.05), torch.optim.SGD(groups[1]["params"], lr=0.05)]
    if amp is not None:
        model, opts = amp_patch.initialize(model, opts, opt_level="O2", verbosity=0, **amp)
    torch.manual_seed(1)
    for _ in range(steps):
        out = model(torch.randint(0, 10, (6,)))
        loss = (out.float() - 1).pow(2).mean()
        if amp is None:
            loss.backward()
        else:
            with amp_patch.scale_loss(loss, opts) as scaled:
                scaled.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return model, out


@pytest.mark.parametrize("kind", ["embedding", "bag"])
@pytest.mark.parametrize("opt_class", [torch.optim.SGD, torch.optim.SparseAdam])
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_a_sparse_embedding_trains_under_o2_as_in_fp32(kind, opt_class, half):
    ref, _ = _run(kind, opt_class)
    scale = {"loss_scale": 128.0} if half is torch.float16 else {}  # (no warm-up skip: the steps are compared)
    model, out = _run(kind, opt_class, amp={"half_dtype": half, **scale})
    assert out.dtype is torch.float32  # (the model's outputs, cast_model_outputs default)
    emb = model.emb if kind == "bag" else model[0]
    assert emb.weight.dtype is torch.float32 and emb.weight.grad is None
    start = _net(kind)
    for (name, got), want, init in zip(model.state_dict().items(), ref.state_dict().values(),
                                       start.state_dict().values()):
        assert not torch.equal(got, init), name
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    amp_patch.deinitialize()
    assert all(torch.equal(trained[k], v) for k, v in model.state_dict().items())


def test_a_sparse_embedding_hands_the_half_dtype_to_the_next_layer():
    model = _net("embedding")
    seen = []
    model[1].register_forward_pre_hook(lambda module, args: seen.append((args[0].dtype, module.weight.dtype)))
    model, opt = amp_patch.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                      half_dtype=torch.bfloat16, verbosity=0)
    model(torch.arange(5))
    assert seen == [(torch.bfloat16, torch.bfloat16)]
