"""apex.optimizers.FusedAdam(capturable=True) with torch's GradScaler, as Apex's kernel took it: the optimizer
unscales the grads itself (``_step_supports_amp_scaling``), so half grads and fp32 master weights work; an
overflow skips the step and leaves the step count alone."""
import warnings

import pytest
import torch

from amp_patch.legacy.apex.optimizers import FusedAdam


def _half_model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).half()


def _backward(model, scaler, poison=False):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).half()
    loss = model(x).float().pow(2).mean()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if poison:
        model.weight.grad[0, 0] = float("inf")


def _step(scaler, opt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch: "GradScaler is going to stop passing itself"
        scaler.step(opt)
    scaler.update()


def test_half_params_with_fp32_masters_step_on_the_unscaled_grads():
    model, twin = _half_model(), _half_model()
    masters = [p.detach().float().clone().requires_grad_() for p in twin.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.0)
    opt = FusedAdam(model.parameters(), lr=1e-2, capturable=True, master_weights=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(3):
        _backward(model, scaler)
        _backward(twin, None)
        for m, p in zip(masters, twin.parameters()):
            m.grad = p.grad.float()
        _step(scaler, opt)
        ref.step()
        for p, t, m in zip(model.parameters(), twin.parameters(), masters):
            torch.testing.assert_close(p.grad, t.grad, rtol=2e-3, atol=1e-4)  # left unscaled, as Apex's kernel
            torch.testing.assert_close(p, m.detach().half(), rtol=2e-3, atol=1e-4)
            with torch.no_grad():
                t.copy_(m)
        opt.zero_grad()
        twin.zero_grad()
    assert scaler.get_scale() == 1024.0


def test_an_overflow_skips_the_step_and_keeps_the_step_count():
    model = _half_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = FusedAdam(model.parameters(), lr=1e-2, capturable=True, master_weights=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _backward(model, scaler, poison=True)
    _step(scaler, opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.param_groups[0].get("step", 0) == 0
    assert scaler.get_scale() == 512.0


@pytest.mark.parametrize("capturable", [False, True])
def test_without_a_scaler_capturable_changes_nothing(capturable):
    model, twin = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    opts = [FusedAdam(model.parameters(), lr=1e-2, capturable=capturable), FusedAdam(twin.parameters(), lr=1e-2)]
    for m, opt in ((model, opts[0]), (twin, opts[1])):
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_grads_the_user_unscaled_first_are_not_unscaled_again():
    model, twin = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    opt = FusedAdam(model.parameters(), lr=1e-2, eps=1.0, capturable=True)  # eps=1: the update sees the grad's size
    ref = FusedAdam(twin.parameters(), lr=1e-2, eps=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.unscale_(opt)  # e.g. to clip
    _step(scaler, opt)
    twin(torch.ones(2, 4)).sum().backward()
    ref.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)
