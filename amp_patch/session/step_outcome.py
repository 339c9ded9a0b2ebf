"""What an unscaling exit's outcome does: the loss's scaler is updated (or not, by the counting rule of the API in
use), the optimizers' coming step is doomed after an overflow, and the step history records it (with the cause of
a skip). Called by ``scale_loss``, by framework hooks that unscale outside it and by an optimizer step that unscales
grads a delayed exit left scaled."""
import contextlib

from .._torch import dist
from ..observe.overflow import bad_grads, skip_cause
from ..scaling.stages import DOOMED


def apex_rules(session):
    """The session was opened through Apex's API (``apex.amp`` / ``amp_patch.legacy.amp``): Apex's scaler
    rules apply (docs/migration.md): every unscaling exit updates the loss's scaler."""
    return session.props is not None and session.props.api == "apex"


def _counts(session, scaler, states, found_inf):
    """Whether this unscaling exit updates ``scaler``. amp_patch counts a step once per scaler (GradScaler's
    rule): in a step already doomed by an overflow, only a scaler that has not backed off for it yet backs off
    (a later loss's overflow backs off its own scaler); clean micro-batches after the overflow are not counted.
    Under Apex's API every exit counts (Apex's ``update_scale`` per exit: one back-off per overflowing
    micro-batch, the clean ones counted). Under DDP an exit in a doomed step counts nothing (both APIs): its check
    saw the whole accumulation (OptimizerState.before_backward), so an earlier loss's inf would count again."""
    for state in states:
        if state.next_step is not DOOMED:
            return True
    if not states:
        return True
    if dist.world_size() > 1:
        return False
    if apex_rules(session):
        return True
    return found_inf and not any(state.undo_updates.get(scaler, 0) is None for state in states)


def _mark_skipped(states, scaler):
    """The coming step of each optimizer is skipped, doomed by ``scaler``'s overflow (unless already doomed)."""
    for state in states:
        state.doom(by=scaler)


def _unscaled_apex(session, scaler):
    """Apex's ``scale_loss`` returned early (no unscale, no scaler update: ``unskipped`` stays 0) for a static
    scale of 1.0 without master weights. amp_patch still checks the grads and skips a step with inf/NaN ones
    (Apex's step applied them): a deliberate difference (docs/migration.md)."""
    props = session.props
    return (apex_rules(session) and not scaler.dynamic and scaler.scale == 1.0
            and not (props is not None and props.master_weights))


def finish_step(session, scaler, loss_id, states, found_inf, loss=None):
    losses = _losses(states, loss)
    if _unscaled_apex(session, scaler):
        if found_inf:
            _mark_skipped(states, scaler)
        return
    if not _counts(session, scaler, states, found_inf):
        return
    before, memento = scaler.scale, scaler.memento()
    observe = session.observe
    warming = warming_up(session, scaler, found_inf)
    skip = scaler.update(found_inf)
    for state in states:
        state.note_update(scaler, memento, found_inf)
    if skip:
        _mark_skipped(states, scaler)
    overflow = None
    if observe.diagnoser is not None:
        if found_inf:
            overflow = observe.last_overflow = observe.diagnoser.record(loss_id, before, session.scaling.masters())
        else:
            observe.diagnoser.reset()
    record_update(session, scaler, loss_id, before, skip, warming, losses, overflow)


def _losses(states, loss):
    """The losses whose grads this exit unscales: its own and those of the exits that delayed before it (taken from
    the optimizers' states, which forget them here)."""
    losses = [loss] if loss is not None else []
    for state in states:
        if state.delayed_losses:
            losses += state.delayed_losses
            state.delayed_losses = []
    return losses


def finish_delayed(session, state, scaler, found_inf):
    """``optimizer.step()`` unscaled the grads a delayed (or raised) exit left scaled (``state``'s
    ``_finish_delayed``): the outcome of an unscaling exit, recorded under the loss of ``scaler``. False where this
    session does not own ``scaler`` (the apex alias's per-optimizer scalers): the caller's own update then applies."""
    loss_id = next((i for i, known in enumerate(session.scaling.scalers) if known is scaler), None)
    if loss_id is None:
        return False
    with quiet(session):  # (a skip's cause names the params with inf/NaN grads: ops)
        finish_step(session, scaler, loss_id, (state,), found_inf)
    return True


def quiet(session):
    """amp_patch's own bookkeeping ops run with casting off in this thread."""
    return session.casting.engine.casts_disabled() if session.casting.engine is not None else contextlib.nullcontext()


def warming_up(session, scaler, found_inf):
    """Before ``scaler``'s update for an overflow: whether its skip is the dynamic scaler's warm-up (the history's
    rule; False without a history or an overflow)."""
    history = session.observe.history
    return bool(found_inf) and history is not None and history.warming_up(scaler.loss_id, scaler)


def record_update(session, scaler, loss_id, before, skip, warming, losses=(), overflow=None):
    """The step history's record of one update of ``scaler`` (an unscaling exit's, or Apex's ``update_scale()``
    after ``delay_overflow_check`` exits, where the script's own check decided), with a skip's cause."""
    history = session.observe.history
    if history is None:
        return
    cause = (None, None)
    if skip:
        with quiet(session):  # (naming the params with inf/NaN grads runs ops)
            cause = skip_cause(losses, overflow, warming, before,
                               lambda: bad_grads(session.models, session.scaling.masters()))
    history.add(loss_id, before, scaler.scale, skip, overflow, scaler, cause)
