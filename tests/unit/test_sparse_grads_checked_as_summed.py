"""A float16 sparse grad whose index repeats (an embedding row looked up twice) holds per-index sums, as a dense
float16 grad would and as ``coalesce()`` forms them (SparseAdam, Adagrad), that can be inf: the check answers for
them, so finite halves of an inf sum are an overflow (as GradScaler coalesces float16 sparse grads before its check).
Other dtypes are not coalesced for the check (fp32's range; coalescing a large embedding's grad every step costs)."""
import random

import pytest
import torch

import amp_patch
from amp_patch.scaling import unscale


def _uncoalesced(rng, dtype):
    rows = rng.randint(1, 5)
    index = torch.tensor([[rng.randrange(rows) for _ in range(rng.randint(1, 6))]])
    values = torch.tensor([[rng.choice([1.0, 2e4, 3.5e4, 6e4, -6e4]) for _ in range(2)]
                           for _ in range(index.shape[1])]).to(dtype)
    if rng.random() < 0.1:
        values[0, 0] = rng.choice([float("inf"), float("nan")])
    return torch.sparse_coo_tensor(index, values, (rows, 2), check_invariants=True)


def _sums_non_finite(grad):
    return grad.dtype is torch.float16 and not bool(torch.isfinite(grad.coalesce()._values()).all())


@pytest.mark.parametrize("seed", range(40))
def test_the_check_answers_for_the_summed_values(seed):
    rng = random.Random(seed)
    dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
    grads = [_uncoalesced(rng, dtype) for _ in range(rng.randint(1, 3))]
    scale = rng.choice([1.0, 2.0])
    found = unscale.unscale_collected_(grads, scale)  # (the check before a step)
    assert found is any(_sums_non_finite(g) or not bool(torch.isfinite(g._values()).all())
                        for g in grads)


@pytest.mark.parametrize("value, skipped", [(4e4, True), (2e4, False)])
def test_o3_skips_the_step_whose_repeated_rows_sum_to_inf(value, skipped):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(4, 2, sparse=True)
    opt = torch.optim.SparseAdam(embedding.parameters(), lr=1.0)
    embedding, opt = amp_patch.initialize(embedding, opt, opt_level="O3", half_dtype=torch.float16, verbosity=0)
    before = embedding.weight.detach().clone()
    with amp_patch.scale_loss((embedding(torch.tensor([1, 1])).float() * value).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp_patch.last_step_skipped(opt) is skipped
    assert torch.isfinite(embedding.weight).all()
    if skipped:
        assert torch.equal(embedding.weight, before)
        assert "weight" in amp_patch.history()[-1]["cause"]


def test_a_large_fp32_sparse_grad_is_not_coalesced_for_the_check(monkeypatch):
    """fp32 (and bf16) sums overflow only where fp32's would: the check leaves their coalescing to the optimizer."""
    grad = torch.sparse_coo_tensor(torch.tensor([[0, 0, 1]]), torch.ones(3, 4), (5, 4), check_invariants=True)
    monkeypatch.setattr(torch.Tensor, "coalesce", lambda self: pytest.fail("coalesced for the check"))
    assert unscale.unscale_collected_([grad, grad.bfloat16()], 1.0) is False


@pytest.mark.parametrize("seed", range(30))
def test_the_check_agrees_with_gradscaler_on_float16_sparse_grads(seed):
    """torch's GradScaler (code amp_patch did not write) coalesces float16 sparse grads and checks their values. At a
    scale of 1.0 both find inf/NaN on the same grads or neither does. At a larger scale GradScaler sums the scaled
    values, amp_patch the unscaled ones the optimizer reads: amp_patch finds an overflow only where GradScaler does
    (a sum finite scaled is finite unscaled). Where neither finds one, both leave the same values."""
    rng = random.Random(seed)
    grads = [_uncoalesced(rng, torch.float16) for _ in range(rng.randint(1, 3))]
    scale = rng.choice([1.0, 1.0, 2.0, 4.0])
    params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=torch.float16)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt = torch.optim.SGD(params, lr=0.1)
    # (allow_fp16: torch's public unscale_ refuses float16 params, which O3 trains; it returns a flag per device)
    flags = torch.amp.GradScaler("cpu")._unscale_grads_(opt, torch.full((1,), 1.0 / scale), torch.zeros(1), True)
    theirs = any(bool(flag.item()) for flag in flags.values())
    ours_grads = [g.clone() for g in grads]
    ours = unscale.unscale_collected_(ours_grads, scale)
    assert ours is theirs if scale == 1.0 else (theirs or not ours)
    if not theirs:
        for p, g in zip(params, ours_grads):
            assert torch.equal(p.grad.coalesce().to_dense().view(torch.int16),
                               g.coalesce().to_dense().view(torch.int16))
