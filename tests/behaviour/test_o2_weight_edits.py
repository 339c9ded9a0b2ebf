"""In-place edits of O2 model weights reach the fp32 masters.

WGAN's weight clipping (``for p in D.parameters(): p.data.clamp_(-c, c)`` after each step) and manual weight
surgery change the half model params; the next step used to copy the unedited masters back over them.
"""
import pytest
import torch
import torch.nn.functional as F

import amp_patch

CLIP = 0.01


class Critic(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = torch.nn.Linear(4, 8)
        self.lin2 = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.lin2(F.leaky_relu(self.lin1(x), 0.2))


def _critic_loss(critic, x, step):
    sign = 1.0 if step < 6 else -1.0  # the gradient turns: clipped weights must come back at once
    return sign * critic(x).float().mean()


def _wgan(level=None, half=torch.bfloat16, steps=12):
    critic = Critic()
    opt = torch.optim.RMSprop(critic.parameters(), lr=5e-3)
    if level is not None:
        critic, opt = amp_patch.initialize(critic, opt, opt_level=level, half_dtype=half, verbosity=0,
                                           loss_scale=2.0 ** 8)  # (static: a dynamic one skips the first steps)
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        opt.zero_grad()
        loss = _critic_loss(critic, torch.randn(16, 4, generator=g), step)
        if level is None:
            loss.backward()
        else:
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        for p in critic.parameters():
            p.data.clamp_(-CLIP, CLIP)
    weights = [p.detach().float().clone() for p in critic.parameters()]
    if level is not None:
        amp_patch.deinitialize()
    return weights


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_wgan_clipping_under_o2_follows_the_fp32_reference(half):
    reference = _wgan()
    o2 = _wgan("O2", half)  # after deinitialize: the masters, with the last clip carried
    for ref, got in zip(reference, o2):
        assert got.abs().max() <= CLIP * 1.01  # (the half clip bound rounds up a little)
        assert torch.allclose(got, ref, rtol=0, atol=CLIP * 0.05), (got - ref).abs().max()


def _session():
    model = Critic()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)


def _one_step(model, opt):
    """One step; returns the master grads it applied (step() clears them afterwards, as Apex did)."""
    opt.zero_grad()
    with amp_patch.scale_loss(model(torch.ones(2, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    grads = {id(m): m.grad.clone() for m in amp_patch.master_params(opt) if m.grad is not None}
    opt.step()
    return grads


@pytest.mark.parametrize("edit", ["data_copy", "data_assign", "no_grad_in_place"])
def test_weight_surgery_reaches_the_master(edit):
    model, opt = _session()
    weight = model.lin1.weight
    new = torch.full_like(weight, 0.25)
    master = next(m for m, p in zip(amp_patch.master_params(opt), model.parameters()) if p is weight)
    kept = master.detach().clone()  # (before the edit: under O2 the model's param is the master itself)
    with torch.no_grad():
        if edit == "data_copy":
            weight.data.copy_(new)
        elif edit == "data_assign":
            weight.data = new.clone()
        else:
            weight.copy_(new)
    bias_master = [m.detach().clone() for m in amp_patch.master_params(opt)][1]
    grads = _one_step(model, opt)
    grad = grads[id(master)]
    assert torch.equal(master.detach(), 0.25 - 0.1 * grad), "the step started from the edited weight"
    assert not torch.equal(master.detach(), kept - 0.1 * grad)
    other = [m for m in amp_patch.master_params(opt)][1]  # lin1.bias: not edited, kept at full fp32 precision
    assert torch.equal(other.detach(), bias_master - 0.1 * grads[id(other)])


def test_an_edit_of_some_elements_keeps_the_others_fp32_bits():
    model, opt = _session()
    masters = list(amp_patch.master_params(opt))
    before = masters[0].detach().clone()
    model.lin1.weight.data[0, 0] = 1.0
    opt.zero_grad()
    opt.step()  # (no grads: a plain step still takes the edit)
    after = masters[0].detach()
    assert after[0, 0] == 1.0
    assert torch.equal(after.flatten()[1:], before.flatten()[1:])


def test_a_shape_change_is_the_optimizers_too():
    """The model's fp32 param is the master: a resize through .data is what the optimizer holds (no second copy
    left at the old shape to refuse, as under the two-copy layout)."""
    model, opt = _session()
    model.lin2.weight.data = torch.zeros(1, 9)
    opt.step()
    assert [m for m in amp_patch.master_params(opt)][2].shape == (1, 9)


def test_an_edit_after_the_last_step_survives_deinitialize():
    """deinitialize gives the params their masters: an edit after the last step is carried into them first."""
    model, opt, clip = *_session(), 0.2
    _one_step(model, opt)
    masters = [m.detach().clone() for m in amp_patch.master_params(opt)]
    for p in model.parameters():
        p.data.clamp_(-clip, clip)
    amp_patch.deinitialize()
    kept = 0
    for p, m in zip(model.parameters(), masters):
        assert p.dtype is torch.float32 and p.abs().max() <= clip * 1.01  # (the bf16 bound rounds up a little)
        inside = m.abs() < clip * 0.99
        assert torch.equal(p.detach()[inside], m[inside])  # the unclipped rest keeps its fp32 bits
        kept += int(inside.sum())
    assert kept > 0


def test_state_dict_after_an_edit_reports_it():
    """model.state_dict() (the masters under O2) includes an edit made since the last step (a checkpoint, or an
    EMA of a WGAN critic, would otherwise save the unclipped weights)."""
    model, opt = _session()
    _one_step(model, opt)
    model.lin1.weight.data.clamp_(-CLIP, CLIP)
    state = model.state_dict()
    assert state["lin1.weight"].dtype is torch.float32 and state["lin1.weight"].abs().max() <= CLIP * 1.01
