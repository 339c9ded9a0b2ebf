"""scale_loss: the per-iteration protocol between backward, the scalers and the optimizers."""
import contextlib
import warnings

import torch

from . import _state, distributed
from .diagnostics import bad_grads, skip_cause
from .errors import ConfigError, UsageError


def current_session(api):
    """The active session, or a UsageError naming ``api`` and the call that must come first."""
    session = _state.current()
    if session is None:
        raise UsageError(f"amp_patch.{api}() was called before amp_patch.initialize(); call "
                         "model, optimizer = amp_patch.initialize(model, optimizer, opt_level=...) first")
    return session


def _optimizer_list(optimizers):
    items = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    for opt in items:
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"scale_loss expects an optimizer or a list of optimizers; got {type(opt).__name__}")
    return items


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False, delay_overflow_check=False):
    """Yield ``loss.float() * scale``; on exit unscale grads, check for inf/NaN and update the loss's scaler.

    ``model`` (optional): the DDP-wrapped model; under master weights a non-delayed exit inside its
    ``no_sync()`` is refused (those grads would leave ``param.grad`` before DDP reduces them).
    ``delay_overflow_check`` is accepted for Apex compatibility and ignored.
    """
    session = current_session("scale_loss")
    if not session.enabled:
        yield loss
        return
    scaler = session.scaler(loss_id)
    states = [session.state_for(opt) for opt in _optimizer_list(optimizers)]
    if session.engine is not None:
        session.engine.resume_after_step()
    if model is not None and any(state.pairs for state in states):
        distributed.check_unscale_inside_no_sync(model, delay_unscale)
    if not session.masters_checked:
        session.masters_checked = True
        _warn_if_masters_diverged(states)
    for state in states:
        state.before_backward(scaler)
    yield loss.float() * scaler.scale
    with _quiet(session):  # amp_patch's own bookkeeping ops must not run through the casting wrappers
        found_inf = False
        for state in states:
            found_inf |= state.after_backward(scaler, delay_unscale)
        if not delay_unscale:
            _finish_step(session, scaler, loss_id, states, distributed.agree_overflow(found_inf), loss)
    session.clear_cache()


def _quiet(session):
    return session.engine.casts_disabled() if session.engine is not None else contextlib.nullcontext()


def _warn_if_masters_diverged(states):
    """Once per session: under DDP + master weights, rank 0's half params may have replaced ours."""
    if not any(state.pairs for state in states) or distributed.world_size() == 1:
        return
    if distributed.masters_out_of_sync():
        warnings.warn("amp_patch: the fp32 master weights do not match the half model weights (DDP broadcast rank "
                      "0's half params at construction, the masters kept this rank's values). Call "
                      "amp_patch.distributed.broadcast_master_params() once after wrapping the model in DDP, or "
                      "build identical weights on every rank.", RuntimeWarning, stacklevel=4)


def _finish_step(session, scaler, loss_id, states, found_inf, loss=None):
    if states and all(state.skip_next for state in states):
        return  # a later micro-batch of a step already doomed by an overflow: the step counts once
    before = scaler.scale
    warming_up = session.history is not None and session.history.warming_up(loss_id, scaler)
    skip = scaler.update(found_inf)
    if skip:
        for state in states:
            state.skip_next = True
    overflow = None
    if session.diagnoser is not None:
        if found_inf:
            overflow = session.last_overflow = session.diagnoser.record(loss_id, before, session.masters())
        else:
            session.diagnoser.reset()
    if session.history is not None:
        cause = (None, None)
        if skip:
            cause = skip_cause(loss, overflow, warming_up, before,
                               lambda: bad_grads(session.models, session.masters()))
        session.history.add(loss_id, before, scaler.scale, skip, overflow, scaler, cause)
