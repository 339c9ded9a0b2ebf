"""The recipes of docs/recipes.md, each checked against an fp32 reference (tolerances as in
test_loss_scaling_end_to_end)."""
import pytest
import torch
import torch.nn.functional as F

import amp_patch

RTOL, ATOL = 2e-2, 2e-3


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)


def _penalty_loss(model, x, y, grad_of_input):
    return F.mse_loss(model(x).float(), y) + 0.1 * grad_of_input.float().pow(2).sum()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gradient_penalty_with_the_public_scale(level):
    x, y = _data()
    ref = _net()
    xr = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(F.mse_loss(ref(xr), y), xr, create_graph=True)
    _penalty_loss(ref, xr, y, g).backward()

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, loss_scale=256.0, verbosity=0)
    xa = x.clone().requires_grad_(True)
    scaled = F.mse_loss(model(xa).float(), y) * amp_patch.loss_scale()
    (g_scaled,) = torch.autograd.grad(scaled, xa, create_graph=True)
    g = g_scaled / amp_patch.loss_scale()
    with amp_patch.scale_loss(_penalty_loss(model, xa, y, g), opt) as scaled_loss:
        scaled_loss.backward()
    for p_ref, p in zip(ref.parameters(), amp_patch.master_params(opt)):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=RTOL, atol=ATOL)


def test_gradient_clipping_o1():
    x, y = _data()
    ref = _net()
    F.mse_loss(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", verbosity=0)
    with amp_patch.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    norm = torch.nn.utils.clip_grad_norm_(amp_patch.master_params(opt), 0.05)
    torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL)
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=RTOL, atol=ATOL)


def test_o1_casting_with_native_grad_scaler():
    x, y = _data()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = amp_patch.initialize(model, opt_level="O1", loss_scale=1.0, verbosity=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    out = model(x)
    assert out.dtype is torch.float16
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(F.mse_loss(out.float(), y)).backward()
    scaler.step(opt)
    scaler.update()
    assert all(p.grad.dtype is torch.float32 for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0 ** 10


def test_autocast_decorates_a_forward():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        @amp_patch.autocast(half_dtype=torch.bfloat16)
        def forward(self, x):
            return F.softmax(self.fc(x), dim=-1), self.fc(x)

    net = Net()
    probs, logits = net(torch.randn(2, 4))
    assert probs.dtype is torch.float32 and logits.dtype is torch.bfloat16
    assert net.fc(torch.randn(2, 4)).dtype is torch.float32  # outside the decorated forward


def test_autocast_inside_an_o1_session_can_switch_casting_off():
    model = amp_patch.initialize(_net(), opt_level="O1", verbosity=0)
    x = torch.randn(2, 4)
    assert model(x).dtype is torch.float16
    with amp_patch.autocast(enabled=False):
        assert model(x).dtype is torch.float32
    with amp_patch.autocast():
        assert model(x).dtype is torch.float16
