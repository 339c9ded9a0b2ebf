"""The fp8 category against torchao's float8 training (the reference implementation, a test-only dependency).

The oracle: the same MLP converted with ``torchao.float8.convert_to_float8_training`` (recipe ``tensorwise`` or
``rowwise``) and run under native ``torch.autocast("cpu", bfloat16)``; against amp_patch O1 bf16 with F.linear in
the fp8 category (the shipped ``fp8_linear_cpu`` lists). Forward output and every gradient must be bitwise equal;
bf16 O1 (``torch_cpu``) is shown to differ, so the comparison can fail. Skipped where torchao cannot import.
"""
import copy
import warnings

import pytest
import torch
from torch import nn

import amp_patch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ao_float8 = pytest.importorskip("torchao.float8", reason="torchao (float8 training) is not importable here")

LISTS = {"tensorwise": "fp8_linear_cpu", "rowwise": "fp8_linear_cpu_rowwise"}


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))


def _torchao(model, recipe):
    converted = copy.deepcopy(model)
    ao_float8.convert_to_float8_training(converted, config=ao_float8.Float8LinearConfig.from_recipe_name(recipe))
    return converted


def _loss(out, target):
    return (out.float() - target).pow(2).mean()


def _torchao_step(model, x, target):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    loss = _loss(out, target)
    loss.backward()
    return out, loss


def _o1_step(model, x, target, op_lists):
    model = amp_patch.initialize(model, opt_level="O1", half_dtype=torch.bfloat16, op_lists=op_lists, verbosity=0)
    try:
        out = model(x)
        loss = _loss(out, target)
        loss.backward()
    finally:
        amp_patch.deinitialize()
    return out, loss


def _max_diffs(model, out, reference, ref_out):
    diffs = [(out.float() - ref_out.float()).abs().max().item()]
    diffs += [(p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())]
    return diffs


@pytest.mark.parametrize("recipe", sorted(LISTS))
def test_mlp_forward_and_grads_are_bitwise_torchaos(recipe):
    base, x, target = _mlp(), torch.randn(32, 32), torch.randn(32, 16)
    reference = _torchao(base, recipe)
    ref_out, ref_loss = _torchao_step(reference, x, target)
    ours = copy.deepcopy(base)
    out, loss = _o1_step(ours, x, target, LISTS[recipe])
    assert out.dtype == ref_out.dtype == torch.bfloat16
    assert torch.equal(out, ref_out) and torch.equal(loss, ref_loss)
    for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
        assert p.grad.dtype == q.grad.dtype == torch.float32
        assert torch.equal(p.grad, q.grad), (name, (p.grad - q.grad).abs().max().item())
    # the comparison can fail: bf16 O1 (linear in half) is not torchao's fp8
    plain = copy.deepcopy(base)
    half_out, _ = _o1_step(plain, x, target, "torch_cpu")
    assert max(_max_diffs(plain, half_out, reference, ref_out)) > 0


@pytest.mark.parametrize("recipe", sorted(LISTS))
def test_a_short_training_run_follows_torchaos_loss(recipe):
    steps, base = 6, _mlp(1)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g)) for _ in range(steps)]
    reference = _torchao(base, recipe)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_losses = []
    for x, target in batches:
        ref_opt.zero_grad()
        ref_losses.append(_torchao_step(reference, x, target)[1].item())
        ref_opt.step()
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16,
                                      op_lists=LISTS[recipe], verbosity=0)
    losses = []
    try:
        for x, target in batches:
            opt.zero_grad()
            loss = _loss(model(x), target)
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        amp_patch.deinitialize()
    assert losses == ref_losses
    assert ref_losses[-1] < ref_losses[0]  # it trains
