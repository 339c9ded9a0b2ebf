"""What a script reads from (and restores into) the active session: master params, loss scales, skipped steps, the
scalers' state, the overflow records; and the cast cache's clear."""
from ..scaling.scaler import load_state_dict_into, state_dict_for
from . import state as _state


def clear_cache():
    """Drop every cached half cast (scale_loss does this at the end of each iteration)."""
    session = _state.current()
    engine = _state.active_engine()
    if session is not None:
        session.clear_cache()
    elif engine is not None:
        engine.clear_cache()


def master_params(optimizer):
    """The params ``optimizer`` updates (fp32 masters under O2, else the model's own: half under O3); clip these."""
    session = _state.current_session("master_params")
    if not session.enabled:
        return iter([p for g in optimizer.param_groups for p in g["params"]])
    return session.scaling.state_for(optimizer).master_params()


def last_step_skipped(optimizer):
    """True when the optimizer's last ``step()`` was skipped because of an overflow."""
    session = _state.current_session("last_step_skipped")
    return session.scaling.state_for(optimizer).last_skipped if session.enabled else False


def loss_scale(loss_id=0):
    """The current loss scale of ``loss_id`` (e.g. to unscale an autograd.grad gradient penalty)."""
    session = _state.current_session("loss_scale")
    return session.scaling.scaler(loss_id).scale if session.enabled else 1.0


def state_dict():
    """Every scaler's state: ``{"loss_scaler0": {...}, ...}`` (Apex's keys plus amp_patch's extras)."""
    session = _state.current_session("state_dict")
    return state_dict_for(session.scaling.scalers) if session.enabled else {}


def load_state_dict(state):
    """Restore the scalers from ``state_dict()`` output (Apex checkpoints load too)."""
    session = _state.current_session("load_state_dict")
    if session.enabled:
        load_state_dict_into(session.scaling.scalers, state)


def last_overflow():
    """The record of the last overflow seen with ``diagnose_overflow=True`` (None if none yet)."""
    return _state.current_session("last_overflow").observe.last_overflow


def history():
    """Per-step records (loss id, scale before/after, skipped, overflow record), oldest first."""
    session = _state.current_session("history")
    if session.observe.history is None:
        return []
    return session.observe.history.rows({i: scaler.undone for i, scaler in enumerate(session.scaling.scalers)})
