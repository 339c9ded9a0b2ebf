"""The usual check at a scale of 1.0 (one kernel call, no grouping) answers as the general grouped path does, for any
list of grads a step can hand it: dtypes mixed, a grad listed twice, sparse, non-contiguous, a tensor subclass, a
grad on another device than the first's (meta here), inf/NaN anywhere or nowhere; the grads' values stay as they
were (x * 1.0 == x)."""
import random

import pytest
import torch

from amp_patch.scaling import unscale


class _Sub(torch.Tensor):
    pass


def _grad(rng):
    kind = rng.choice(["dense", "dense", "dense", "sparse", "strided", "subclass", "other device"])
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.float64])
    values = torch.randn(rng.randint(1, 40), generator=torch.Generator().manual_seed(rng.randint(0, 999))).to(dtype)
    if rng.random() < 0.2:
        values[rng.randrange(values.numel())] = rng.choice([float("inf"), float("-inf"), float("nan")])
    if kind == "sparse":
        index = torch.arange(values.numel()).unsqueeze(0)
        return torch.sparse_coo_tensor(index, values, (values.numel() + 3,), check_invariants=True).coalesce()
    if kind == "strided":
        return torch.stack([values, values]).t()[:, 0]  # a non-contiguous view
    if kind == "subclass":
        return values.as_subclass(_Sub)
    if kind == "other device":
        return values.to("meta")
    return values


def _outcome(check):
    """What the check answered, or the kind of error it raised."""
    try:
        return check()
    except (NotImplementedError, RuntimeError) as exc:
        return type(exc).__name__


def _values(grads):
    return [(g._values() if g.is_sparse else g).detach().clone() for g in grads if not g.is_meta]


@pytest.mark.parametrize("seed", range(60))
def test_the_check_at_scale_one_answers_as_the_general_path(seed):
    rng = random.Random(seed)
    grads = [_grad(rng) for _ in range(rng.randint(1, 6))]
    if rng.random() < 0.3:
        grads.append(grads[0])  # a grad listed twice
    before = _values(grads)
    want = _outcome(lambda: unscale.unscale_collected_([g.clone() for g in grads], 1.0))
    got = _outcome(lambda: unscale.unscale_usual_(grads, 1.0))
    assert got == want and type(got) is type(want), (
        f"grads {[(g.dtype, g.layout, g.device.type, type(g).__name__) for g in grads]}")
    for b, a in zip(before, _values(grads)):
        assert torch.equal(b.view(torch.uint8), a.view(torch.uint8))  # bitwise: NaNs too


def test_the_check_at_scale_one_is_one_kernel_call_without_grouping(monkeypatch):
    grads = [torch.randn(3), torch.randn(2).bfloat16()]
    monkeypatch.setattr(unscale, "_group", lambda tensors: pytest.fail("grouped"))
    assert unscale.unscale_usual_(grads, 1.0) is False
    grads[1][0] = float("nan")
    assert unscale.unscale_usual_(grads, 1.0) is True
