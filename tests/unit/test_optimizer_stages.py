"""The named stages of one optimizer's scale_loss protocol (scaling/stages.py) follow the documented machine."""
import torch

import amp_patch
from amp_patch.scaling.stages import Grads, NextStep
from amp_patch.session import state as _state


def _setup(num_losses=1):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0,
                                      num_losses=num_losses)
    return model, opt, _state.current().scaling.state_for(opt)


def _loss(model, bad=False):
    out = model(torch.ones(1, 2)).float().sum() / 1024  # (its grads times 2**16 stay finite in float16)
    return out * float("inf") if bad else out


def test_grads_are_scaled_inside_the_block_and_unscaled_after_it():
    model, opt, state = _setup()
    assert state.grads is Grads.UNSCALED
    with amp_patch.scale_loss(_loss(model), opt) as scaled:
        assert state.grads is Grads.SCALED and state.pending.scaler is _state.current().scaling.scaler(0)
        scaled.backward()
    assert state.grads is Grads.UNSCALED and state.next_step is NextStep.READY


def test_delay_unscale_keeps_the_grads_scaled_until_step_finishes_them():
    model, opt, state = _setup()
    with amp_patch.scale_loss(_loss(model), opt, delay_unscale=True) as scaled:
        scaled.backward()
    assert state.grads is Grads.SCALED
    opt.step()
    assert state.grads is Grads.UNSCALED and not amp_patch.last_step_skipped(opt)


def test_an_overflow_dooms_the_next_step_and_names_its_scaler_once():
    model, opt, state = _setup(num_losses=2)
    first = _state.current().scaling.scaler(0)
    with amp_patch.scale_loss(_loss(model, bad=True), opt, loss_id=0) as scaled:
        scaled.backward()
    assert state.next_step is NextStep.DOOMED and state.doomed_by is first
    with amp_patch.scale_loss(_loss(model, bad=True), opt, loss_id=1) as scaled:
        assert state.grads is Grads.SCALED and state.next_step is NextStep.DOOMED  # both stages at once
        scaled.backward()
    assert state.doomed_by is first  # an already doomed step keeps its first doomer
    opt.step()
    assert amp_patch.last_step_skipped(opt) and state.next_step is NextStep.READY


def test_zero_grad_forgets_the_pending_scale_and_the_doom():
    model, opt, state = _setup()
    with amp_patch.scale_loss(_loss(model, bad=True), opt) as scaled:
        scaled.backward()
    with amp_patch.scale_loss(_loss(model), opt, delay_unscale=True) as scaled:
        scaled.backward()
    assert state.grads is Grads.SCALED and state.next_step is NextStep.DOOMED and state.doomed_by is not None
    opt.zero_grad()
    assert state.grads is Grads.UNSCALED and state.next_step is NextStep.READY and state.doomed_by is None


def test_an_entry_that_finds_no_grad_pardons_a_doomed_step():
    model, opt, state = _setup()
    with amp_patch.scale_loss(_loss(model, bad=True), opt) as scaled:
        scaled.backward()
    assert state.next_step is NextStep.DOOMED
    model.zero_grad()  # the overflowed grads are gone: nothing is left to skip
    with amp_patch.scale_loss(_loss(model), opt) as scaled:
        assert state.next_step is NextStep.READY
        scaled.backward()
    opt.step()
    assert not amp_patch.last_step_skipped(opt)


def test_an_overflow_found_when_step_finishes_a_delayed_backward_names_that_losss_scaler():
    """(Apex's skip message, under the alias, names the loss scaler ``doomed_by`` holds.)"""
    model, opt, state = _setup(num_losses=2)
    second = _state.current().scaling.scaler(1)
    with amp_patch.scale_loss(_loss(model, bad=True), opt, loss_id=1, delay_unscale=True) as scaled:
        scaled.backward()
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append(state.doomed_by))  # after amp_patch's own pre-hook
    opt.step()
    assert amp_patch.last_step_skipped(opt) and seen == [second]
