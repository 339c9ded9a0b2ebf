"""The scale-1.0 gradient check for large gradients (bf16, O0, O3): more than 2**18 elements with threads.

That path sums each grad in fp32 instead of running the fused check-and-unscale kernel; a finite set of grads
whose sum overflows fp32 (300,000 x 1e34, or values near fp32's maximum 3.4028e38) must not count as an overflow,
and any inf/NaN must.
"""
import pytest
import torch

import amp_patch
from amp_patch.scaling import unscale

N = 300_000  # > 2**18 = 262,144
FP32_MAX = torch.finfo(torch.float32).max


@pytest.fixture
def threads(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    calls = []
    real = unscale._any_nonfinite
    monkeypatch.setattr(unscale, "_any_nonfinite", lambda groups: calls.append(1) or real(groups))
    yield calls
    torch.set_num_threads(before)


def _grads(dtype, fill, special=None):
    grads = [torch.full((N // 2,), fill, dtype=dtype), torch.full((N - N // 2,), fill, dtype=dtype)]
    if special is not None:
        grads[1][-1] = special
    return grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fill", [1e34, FP32_MAX, -FP32_MAX * 0.99])
def test_finite_grads_whose_sum_overflows_fp32_are_not_an_overflow(threads, dtype, fill):
    big = torch.finfo(dtype).max
    grads = _grads(dtype, max(min(fill, big), -big))
    expected = [g.clone() for g in grads]
    assert torch.isinf(grads[0].sum(dtype=torch.float32))  # the fast sum alone would call this an overflow
    assert unscale.unscale_(grads, 1.0) is False
    assert threads, "the large-gradient path was not taken"
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))  # scale 1.0 leaves the values alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("special", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("fill", [1.0, 1e34])
def test_one_non_finite_value_is_an_overflow(threads, dtype, special, fill):
    fill = min(fill, torch.finfo(dtype).max)
    assert unscale.unscale_(_grads(dtype, fill, special), 1.0) is True
    assert threads


def test_o0_step_with_huge_finite_grads_is_taken(threads):
    weight = torch.nn.Parameter(torch.zeros(N))
    model = torch.nn.Module()
    model.weight = weight
    opt = torch.optim.SGD([weight], lr=1e-40)
    model, opt = amp_patch.initialize(model, opt, opt_level="O0", verbosity=0)
    coeff = torch.full((N,), 1e34)
    for special, skipped in ((None, False), (float("inf"), True)):
        if special is not None:
            coeff[-1] = special
        opt.zero_grad()
        with amp_patch.scale_loss((weight * coeff).sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        assert amp_patch.last_step_skipped(opt) is skipped
    assert threads
