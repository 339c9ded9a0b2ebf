"""Loss-scaler counting: Apex's rules under Apex's API, GradScaler's under amp_patch's own (docs/migration.md).

The expected figures are what Apex's ``LossScaler.update_scale`` (e13873de) computes for the same sequence:
one call per unscaling ``scale_loss`` exit, back-off on an overflow, ``_unskipped += 1`` otherwise.
"""
import pytest
import torch

import amp_patch
from amp_patch import legacy
from amp_patch.legacy.amp_state import AMP_STATE


def _tiny(n=1):
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 2) for _ in range(n)]
    optimizer = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    return models, optimizer


def _apex(n=1, **kwargs):
    models, optimizer = _tiny(n)
    return legacy.amp.initialize(models, optimizer, verbosity=0, **kwargs), legacy.amp.scale_loss


def _own(n=1, **kwargs):
    models, optimizer = _tiny(n)
    return amp_patch.initialize(models, optimizer, verbosity=0, **kwargs), amp_patch.scale_loss


def _backward(model, optimizer, scale_loss, bad, loss_id=0):
    loss = model(torch.ones(2, 3)).float().sum() * (float("inf") if bad else 1e-3)
    with scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
        scaled.backward()


def _counters(loss_id=0):
    state = amp_patch.session.state.current().scaling.scalers[loss_id].state_dict()
    return state["loss_scale"], state["unskipped"]


# micro-batches (1: overflow) -> (scale, unskipped) after the step, Apex's rule / amp_patch's own rule
MICRO_BATCHES = [((0, 0, 0), (2.0 ** 16, 3), (2.0 ** 16, 3)),
                 ((1, 0, 0), (2.0 ** 15, 2), (2.0 ** 15, 0)),
                 ((0, 1, 1), (2.0 ** 14, 0), (2.0 ** 15, 0)),
                 ((1, 1, 0), (2.0 ** 14, 1), (2.0 ** 15, 0))]


@pytest.mark.parametrize("pattern, apex, own", MICRO_BATCHES)
def test_micro_batches_without_delay_unscale(pattern, apex, own):
    for start, expected in ((_apex, apex), (_own, own)):
        ((models, optimizer), scale_loss) = start(opt_level="O1")
        try:
            optimizer.zero_grad()
            for bad in pattern:
                _backward(models[0], optimizer, scale_loss, bad)
            optimizer.step()
            assert _counters() == expected, (start.__name__, pattern)
            assert amp_patch.last_step_skipped(optimizer) == any(pattern)
        finally:
            amp_patch.deinitialize()


@pytest.mark.parametrize("start", [_apex, _own])
def test_a_later_losss_overflow_in_a_doomed_step_backs_off_its_own_scaler(start):
    """Loss 0 overflows first; loss 1's overflow in the same (already skipped) step still halves scaler 1."""
    ((models, optimizer), scale_loss) = start(2, opt_level="O1", num_losses=2)
    try:
        optimizer.zero_grad()
        _backward(models[0], optimizer, scale_loss, True, loss_id=0)
        _backward(models[1], optimizer, scale_loss, True, loss_id=1)
        optimizer.step()
        assert _counters(0) == (2.0 ** 15, 0) and _counters(1) == (2.0 ** 15, 0)
    finally:
        amp_patch.deinitialize()


def test_static_scale_1_without_masters_counts_nothing_under_apex():
    """Apex's scale_loss returned early: ``unskipped`` stays 0. amp_patch still skips an inf step (Apex took it)."""
    ((models, optimizer), scale_loss) = _apex(opt_level="O1", loss_scale=1.0)
    try:
        for bad in (0, 0, 1):
            optimizer.zero_grad()
            _backward(models[0], optimizer, scale_loss, bad)
            optimizer.step()
        assert _counters() == (1.0, 0) and AMP_STATE.loss_scalers[0]._unskipped == 0
        assert amp_patch.last_step_skipped(optimizer)
    finally:
        amp_patch.deinitialize()
    ((models, optimizer), scale_loss) = _own(opt_level="O1", loss_scale=1.0)
    try:
        _backward(models[0], optimizer, scale_loss, False)
        optimizer.step()
        assert _counters() == (1.0, 1)  # amp_patch's own API counts the clean step
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("start", [_apex, _own])
def test_grads_before_the_overflowing_micro_batch_are_kept_until_the_skipped_step(start):
    """Apex's rule: a micro-batch after the overflow is checked alone, the grads accumulate as without amp
    (the earlier micro-batches' are kept); the skipped step clears them all (amp_patch's rule, docs)."""
    ((models, optimizer), scale_loss) = start(opt_level="O1")
    model = models[0]
    try:
        optimizer.zero_grad()
        _backward(model, optimizer, scale_loss, False)
        first = model.bias.grad.clone()
        _backward(model, optimizer, scale_loss, True)
        assert not torch.isfinite(model.bias.grad).all()
        _backward(model, optimizer, scale_loss, False)
        assert not torch.isfinite(model.bias.grad).all()  # inf + the third micro-batch's grads, as autograd sums
        assert _counters()[0] == 2.0 ** 15  # the third micro-batch was clean: no second back-off
        optimizer.step()
        assert model.bias.grad is None and first.abs().sum() > 0
        _backward(model, optimizer, scale_loss, False)
        assert torch.equal(model.bias.grad, first)  # nothing of the skipped step is added into the next one
    finally:
        amp_patch.deinitialize()
