"""Fault injection: an exception (or a real SIGINT) at each point of a training step, under O1/O2/O3 x fp16/bf16.

Each run trains 4 steps of 2 micro-batches (the first with delay_unscale=True), calling
``optimizer.zero_grad()`` at the start of each step, as a plain PyTorch loop does. The faulty run
raises during step 1 and carries on; the reference run never sees step 1's batch. Everything after must
be bit-identical (params, optimizer state, loss scale), and ``deinitialize()`` must give back the same
param and buffer objects in their original dtypes with float32 (or no) grads.
"""
import copy
import os
import signal

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from amp_patch.scaling.stages import Grads, NextStep

POINTS = ("forward", "after_delayed", "before_backward", "after_backward", "sigint_backward", "step")
LEVELS = [("O1", torch.float16), ("O1", torch.bfloat16), ("O2", torch.float16), ("O2", torch.bfloat16),
          ("O3", torch.float16), ("O3", torch.bfloat16)]
FAULT_STEP = 1


class Fault(Exception):
    pass


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = torch.nn.Linear(4, 8)
        self.lin2 = torch.nn.Linear(8, 2)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 8))

    def forward(self, x):
        return self.lin2(torch.relu(self.lin1(x) + self.shift))


def fixed_batches():
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(2)] for _ in range(4)]


def _loss(model, x, y, fault):
    if fault == "forward":
        handle = model.lin1.register_forward_hook(lambda *a: (_ for _ in ()).throw(Fault("in forward")))
        try:
            model(x)
        finally:
            handle.remove()
    out = model(x)
    if fault == "sigint_backward":
        out.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGINT))
    return F.mse_loss(out.float(), y)


def _train_step(model, opt, micro, fault=None):
    opt.zero_grad()
    (x1, y1), (x2, y2) = micro
    with amp_patch.scale_loss(_loss(model, x1, y1, None), opt, delay_unscale=True) as scaled:
        scaled.backward()
    if fault == "after_delayed":
        raise Fault("between micro-batches")
    loss = _loss(model, x2, y2, fault)
    with amp_patch.scale_loss(loss, opt) as scaled:
        if fault == "before_backward":
            raise Fault("before backward")
        scaled.backward()
        if fault == "after_backward":
            raise Fault("after backward")
    handle = None
    if fault == "step":  # runs after amp_patch's own step pre-hook
        handle = opt.register_step_pre_hook(lambda *a: (_ for _ in ()).throw(Fault("in step")))
    try:
        opt.step()
    finally:
        if handle is not None:
            handle.remove()


def _kwargs(level, dtype):
    return {"opt_level": level, "half_dtype": dtype, "verbosity": 0}


def _run(level, dtype, fault):
    """Train; returns (model, optimizer, scaler states, momentum, originals before initialize)."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [(t, t.dtype) for t in list(model.parameters()) + list(model.buffers())]
    model, opt = amp_patch.initialize(model, opt, **_kwargs(level, dtype))
    for i, micro in enumerate(fixed_batches()):
        if i != FAULT_STEP:
            _train_step(model, opt, micro)
        elif fault is not None:
            with pytest.raises(KeyboardInterrupt if fault == "sigint_backward" else Fault):
                _train_step(model, opt, micro, fault)
    scale = amp_patch.state_dict()  # every scaler's full state: scale, growth/hysteresis trackers, step counts
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in amp_patch.master_params(opt)]
    amp_patch.deinitialize()
    return model, opt, scale, momentum, before


@pytest.mark.parametrize("level,dtype", LEVELS, ids=[f"{lv}-{str(dt)[6:]}" for lv, dt in LEVELS])
def test_a_failed_step_is_forgotten_after_zero_grad(level, dtype):
    ref_model, _, ref_scale, ref_momentum, _ = _run(level, dtype, None)
    ref_state = {k: v.clone() for k, v in ref_model.state_dict().items()}
    for point in POINTS:
        model, opt, scale, momentum, before = _run(level, dtype, point)
        assert scale == ref_scale, point
        for name, value in model.state_dict().items():
            assert torch.equal(value, ref_state[name]), f"{point}: {name} differs from the run without the batch"
        for mine, ref in zip(momentum, ref_momentum):
            assert torch.equal(mine, ref), f"{point}: optimizer momentum differs"
        after = list(model.parameters()) + list(model.buffers())
        assert all(a is b and a.dtype is dt for (a, dt), b in zip(before, after)), f"{point}: objects/dtypes"
        assert all(p.grad is None or p.grad.dtype is torch.float32 for p in model.parameters()), point
        assert [p.grad is None for p in model.parameters()] == [p.grad is None for p in ref_model.parameters()], point
        assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters()), point


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_deinitialize_after_an_interrupted_backward_leaves_no_half_grad(level):
    """O3's half grads belong to the half model and go; O2's grads are the fp32 params' own, given back without
    the loss scale (what the backward would have left without amp_patch, to half precision)."""
    model = Net()
    reference = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
    (x, y), _ = fixed_batches()[0]
    with pytest.raises(Fault):
        with amp_patch.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
            raise Fault("after backward")
    amp_patch.deinitialize()
    assert all(p.dtype is torch.float32 for p in model.parameters())
    if level == "O3":
        assert all(p.grad is None for p in model.parameters())
    else:
        F.mse_loss(reference(x), y).backward()
        for p, ref in zip(model.parameters(), reference.parameters()):
            assert p.grad.dtype is torch.float32
            torch.testing.assert_close(p.grad, ref.grad, rtol=2e-2, atol=2e-3)
    opt.zero_grad()
    assert model.shift.dtype is torch.float32
    F.mse_loss(model(x), y).backward()  # fp32 Adam on the restored model works (fp16 grads made it crash)
    opt.step()
    assert all(p.grad.dtype is torch.float32 for p in model.parameters())


def _o2_batch_failed_after_backward():
    """An O2 model whose batch raised after backward: half grads and a pending scale are left behind."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", verbosity=0)
    (x, y), _ = fixed_batches()[0]
    with pytest.raises(Fault):
        with amp_patch.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
            raise Fault("after backward")
    return model, opt, (x, y)


def test_o2_zero_grad_clears_the_half_model_grads_and_the_pending_scale():
    model, opt, (x, y) = _o2_batch_failed_after_backward()
    assert all(p.grad is not None and p.grad.dtype is torch.float32 for p in model.parameters())  # (the fp32 params')
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    state = amp_patch.session.state.current().scaling.state_for(opt)
    assert state.grads is Grads.UNSCALED and state.next_step is NextStep.READY


def test_o1_casting_resumes_when_a_step_raises():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sgd_step = vars(torch.optim.SGD)["step"]
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", verbosity=0)
    (x, y), _ = fixed_batches()[0]
    with amp_patch.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    handle = opt.register_step_pre_hook(lambda *a: (_ for _ in ()).throw(Fault("in step")))
    with pytest.raises(Fault):
        opt.step()
    handle.remove()
    a = torch.randn(2, 2)
    assert torch.mm(a, a).dtype is torch.float16  # the step's post-hook never ran; its class-level guard did
    opt.zero_grad()
    assert torch.mm(a, a).dtype is torch.float16
    amp_patch.deinitialize()
    assert vars(torch.optim.SGD)["step"] is sgd_step


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_module_zero_grad_after_an_overflow_does_not_skip_the_next_step(level):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, loss_scale=128.0, verbosity=0)
    (x, y), (x2, y2) = fixed_batches()[0]
    with amp_patch.scale_loss(F.mse_loss(model(x).float(), y) * float("inf"), opt) as scaled:
        scaled.backward()  # overflow: the next step() would be skipped
    model.zero_grad()  # ... but the batch is abandoned before step()
    with amp_patch.scale_loss(F.mse_loss(model(x2).float(), y2), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not amp_patch.last_step_skipped(opt)


def test_o2_zero_grad_without_set_to_none_then_step_is_not_a_plain_backward():
    model, opt, (x, y) = _o2_batch_failed_after_backward()
    opt.zero_grad(set_to_none=False)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # zero grads on the fp32 params: a no-op step, not "backward outside scale_loss"
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_zero_grad_without_a_step_rolls_back_clean_updates_but_keeps_backoffs(level):
    """A batch dropped before its step() (zero_grad() next) never happened for the scaler, unless it overflowed:
    a backoff is news about the scale (a loop that skips step() on overflow must not retry at the same scale)."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=torch.float16, verbosity=0)
    (x, y), _ = fixed_batches()[0]
    try:
        before = amp_patch.state_dict()
        with amp_patch.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
        assert amp_patch.state_dict() != before  # the clean exit counted a step
        opt.zero_grad()
        assert amp_patch.state_dict() == before
        with amp_patch.scale_loss(F.mse_loss(model(x).float(), y) * float("inf"), opt) as scaled:
            scaled.backward()
        backed_off = amp_patch.state_dict()
        assert backed_off["loss_scaler0"]["loss_scale"] == before["loss_scaler0"]["loss_scale"] / 2
        opt.zero_grad()
        assert amp_patch.state_dict() == backed_off
        with amp_patch.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()  # after a completed step nothing is rolled back
        assert amp_patch.state_dict()["loss_scaler0"]["steps"] == backed_off["loss_scaler0"]["steps"] + 1
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_deinitialize_inside_a_delay_unscale_accumulation_gives_the_grads_back_unscaled(level):
    model = Net()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=torch.float16, verbosity=0)
    (x, y), _ = fixed_batches()[0]
    with amp_patch.scale_loss(F.mse_loss(model(x).float(), y), opt, delay_unscale=True) as scaled:
        scaled.backward()
    assert amp_patch.loss_scale() > 1
    amp_patch.deinitialize()
    F.mse_loss(reference(x), y).backward()
    for p, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, ref.grad, rtol=2e-2, atol=2e-3)
