"""scale_loss: the per-iteration protocol between backward, the scalers and the optimizers."""
import contextlib
import threading
import warnings

import torch

from .._torch import dist
from ..errors import ConfigError, UsageError
from ..parallel import ddp as distributed
from ..scaling.stages import DOOMED
from . import state as _state
from .master_sync import masters_out_of_sync
from .step_outcome import apex_rules, finish_step, quiet

_Tensor = torch.Tensor
_fp32 = torch.float32
_get_ident = threading.get_ident
_new = object.__new__
_ACTIVE = _state.ACTIVE


def _optimizer_list(optimizers):
    items = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not items:
        raise UsageError("scale_loss(loss, []) names no optimizer, so the scaled grads would never be unscaled; "
                         "pass the optimizer(s) whose params this loss trains: scale_loss(loss, optimizer)")
    for opt in items:
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"scale_loss expects an optimizer or a list of optimizers; got {type(opt).__name__}")
    if len({id(opt) for opt in items}) != len(items):  # (its grads would be unscaled once per listing)
        names = [type(opt).__name__ for opt in items]
        raise UsageError(f"scale_loss got an optimizer listed twice ({names}); list each optimizer once: "
                         "scale_loss(loss, [opt_a, opt_b])")
    return items


def _check_loss(loss):
    """A loss scale_loss can scale and backward: a floating scalar tensor that requires grad."""
    if not isinstance(loss, torch.Tensor):
        raise UsageError(f"scale_loss got a {type(loss).__name__} ({loss!r:.40}) as the loss; pass the loss "
                         "tensor itself (not loss.item()): scale_loss(loss, optimizer)")
    if loss.numel() != 1:
        raise UsageError(f"scale_loss got a loss of shape {tuple(loss.shape)}; backward needs a scalar: reduce it "
                         "first, e.g. scale_loss(loss.mean(), optimizer)")
    if not loss.is_floating_point():
        raise UsageError(f"scale_loss got a {loss.dtype} loss, which has no gradient; compute the loss in a "
                         "floating dtype (e.g. criterion(output.float(), target))")
    if not loss.requires_grad:
        raise UsageError("scale_loss got a loss that does not require grad (computed under torch.no_grad(), "
                         "from detached tensors, or from a model with requires_grad=False params); compute it "
                         "with grad enabled, or skip scale_loss for evaluation losses")


def _check_not_nested(states):
    for state in states:
        if state.in_scale_loss:
            raise UsageError(f"scale_loss is already open for this {type(state.optimizer).__name__} optimizer "
                             "(nested scale_loss blocks on one optimizer lose the inner gradient); exit the "
                             "outer block first, or scale the sum: scale_loss(loss1 + loss2, optimizer)")


def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False, delay_overflow_check=False):
    """Yield ``loss.float() * scale``; on exit unscale grads, check for inf/NaN and update the loss's scaler.

    Under master weights an exit inside ``DistributedDataParallel.no_sync()`` is always delayed (the grads
    stay in ``param.grad`` for DDP's next reduction). ``model`` (optional): the DDP-wrapped model; a
    non-delayed exit inside its ``no_sync()`` that amp_patch did not see open is refused.
    ``delay_overflow_check`` (Apex's API only; amp_patch's own ignores it): the exit unscales and checks but does
    not update the scaler nor skip the step; the script's own ``loss_scalers[i].update_scale()`` does, as in
    Apex (NVIDIA BERT's post-accumulation all-reduce path). An exception inside the block
    leaves the grads scaled and pending; ``optimizer.zero_grad()`` then forgets them (docs/usage.md).
    """
    block = _new(_Block)  # (no __init__ frame: every iteration makes one)
    block.args, block.phase = (loss, optimizers, loss_id, model, delay_unscale, delay_overflow_check), _Block.NEW
    return block


class _Block(contextlib.ContextDecorator):
    """One ``scale_loss`` block: a class, not a generator (it runs on every iteration), used as the generator was:
    once, by a ``with`` (or as a decorator, each call its own block); one dropped while open closes as a dropped
    generator's ``finally`` did. :func:`scale_loss` builds it (no ``__init__``: one Python frame less on every
    iteration; an open block's class switched to one with ``__del__`` measured no cheaper than this ``__del__``).

    The usual block of a training loop takes the steady path (:func:`_steady_state`): the state it checks makes
    the general path's argument checks, nesting check, parallel checks, foreign-grad snapshots and notes, overflow
    agreement and scaler counting rule idle, so they are skipped; the transitions themselves (``before_backward``,
    ``after_backward``, ``finish_step``) are the same calls. After backward what the bookkeeping reads costs more
    than in a hot loop (tensor attributes, device objects, objects untouched since the last step; an empty frame
    costs what it costs anywhere, ~0.03 us): this is most of what a small model's step pays for amp_patch."""

    __slots__ = ("args", "phase", "session", "scaler", "states", "delay_unscale", "others", "probe", "steady",
                 "ident")
    NEW, OPEN, DISABLED, DONE = range(4)

    def _recreate_cm(self):
        return scale_loss(*self.args)

    def __enter__(self):
        if self.phase != self.NEW:
            raise UsageError("this scale_loss(...) object was entered already; each block needs its own call: "
                             "'with amp_patch.scale_loss(loss, optimizer) as scaled_loss:' per loss")
        loss, optimizers, loss_id, model, delay_unscale, overflow_check = self.args
        session = _ACTIVE["session"] or _state.current_session("scale_loss")  # (the call raises: none is open)
        if not session.enabled:
            self.phase = self.DISABLED
            return loss
        state = self.steady = _steady_state(session, optimizers, loss_id, model, delay_unscale, overflow_check)
        if state is not None:
            return self._enter_steady(session, loss, state, session.scaling.scalers[loss_id])
        scaler, states, self.delay_unscale = _begin(session, loss, optimizers, loss_id, model, delay_unscale)
        self.others = _foreign_snapshots(session, states)
        scaled, self.probe = _scaled(loss, scaler.scale)
        self.session, self.scaler, self.states = session, scaler, states
        self._open(states)
        return scaled

    def _enter_steady(self, session, loss, state, scaler):
        """:meth:`__enter__` where :func:`_steady_state` holds (what ``_begin`` would still do, in order)."""
        unusual = type(loss) is not _Tensor or not loss.requires_grad or loss.ndim or loss.dtype is not _fp32
        if unusual:  # (a shape of (1,) is unusual too: reading ndim, a property, costs less than calling numel())
            _check_loss(loss)  # (raises, unless a tensor subclass, a half loss or a one-element loss passes)
        engine = session.casting.engine
        if engine is not None and (engine.paused or engine.forwards or engine.fast is not None and engine.fast.depth):
            engine.loss_begins()  # (called only where it has something to do)
        state.open_block(scaler)
        scale = scaler._scale
        if scale != 1.0:  # (the probe watches the loss itself: a backward from it must reach the probe's hook)
            scaled, self.probe = _scaled(loss, scale)
        else:  # (_scaled's usual case; a plain fp32 loss is its own float(): the usual loss skips that call)
            scaled, self.probe = loss.float() if unusual else loss, None
        self.session, self.scaler = session, scaler
        self.ident = ident = _get_ident()  # (_open's and _mark_open's, for the one state)
        self.phase = self.OPEN
        state.in_scale_loss = True
        state.busy[ident] = "a scale_loss block"
        return scaled

    def _open(self, states):
        self.ident, self.phase = threading.get_ident(), self.OPEN
        _mark_open(states, True, self.ident)

    def _leave(self):
        """What every end of an open block does, raised or not: the optimizers are no longer in a block, the probe
        goes, grads written into optimizers the block did not name are noted (none on the steady path)."""
        steady, probe = self.steady, self.probe
        _mark_open((steady,) if steady is not None else self.states, False, self.ident)
        self.phase = self.DONE  # (after: a block interrupted before is still open, and dropping it leaves again)
        if probe is not None:
            probe.remove()
        if steady is None:
            _note_grads_written(self.session, self.states, self.others, self.args[2])

    def __exit__(self, exc_type, exc, tb):
        phase = self.phase
        if phase != self.OPEN:
            if phase == self.NEW:
                raise UsageError("a scale_loss(...) block was exited without being entered; use it in a with "
                                 "statement: 'with amp_patch.scale_loss(loss, optimizer) as scaled_loss:'")
            self.phase = self.DONE  # (a disabled session's block; or exited twice: nothing more to do)
            return False
        steady = self.steady
        if steady is not None and exc_type is None and self.probe is None:
            self._exit_steady(steady)
            return False
        self._leave()
        if exc_type is not None:
            return False
        if self.probe is not None:
            self.probe.check()
        if self.steady is not None:
            self._end_steady()
            return False
        loss, _, loss_id, _, _, delay_overflow_check = self.args
        _end(self.session, self.scaler, loss_id, self.states, self.delay_unscale, loss, delay_overflow_check)
        _note_own_exit(self.session, self.states)  # (after the exit's own changes: set-aside grads added back)
        return False

    def _end_steady(self):
        session, state, scaler = self.session, self.steady, self.scaler
        with quiet(session):
            found_inf = state.after_backward(scaler, False, keep_model_grads=False)  # (no masters: nothing kept)
            finish_step(session, scaler, self.args[2], (state,), found_inf, self.args[0])
        session.clear_cache()

    def _exit_steady(self, state):
        """:meth:`__exit__` of a steady block that raised nothing and has no probe: :meth:`_leave`, then
        :meth:`_end_steady`, in as few frames and reads as the usual step allows. The
        bookkeeping runs no op a casting wrapper could see, so it runs without the quiet switch where nothing else
        would notice its absence. The block is DONE once the optimizer left it (an interrupt before: still open,
        and dropping it leaves again)."""
        session, scaler = self.session, self.scaler
        observe, engine = session.observe, session.casting.engine
        # The quiet path as before where it matters: set-aside grads come back through add_; a closure's overflow
        # zeroes grads; the diagnoser and a trace run ops; a forward that raised inside the block left its native
        # region open, and the quiet switch's enter and exit re-sync it.
        if (observe.diagnoser is not None or state.set_aside or state.stepping
                or engine is not None and (engine.tracer is not None or engine.fast is not None and engine.fast.depth)):
            _mark_open((state,), False, self.ident)
            self.phase = self.DONE
            self._end_steady()
            return
        found_inf = state.close_block(scaler, self.ident)
        self.phase = self.DONE
        props = session.props
        if found_inf or state.next_step is DOOMED or props is not None and props.api == "apex":  # (apex_rules)
            with quiet(session):  # (naming the params with inf/NaN grads runs ops)
                finish_step(session, scaler, self.args[2], (state,), found_inf, self.args[0])
        else:  # (finish_step's clean step of amp_patch's own API)
            before = scaler._scale
            scaler.update(False, state.undo_updates)  # (and note_update)
            if observe.history is not None:
                observe.history.add(self.args[2], before, scaler._scale, False, None, scaler)
        if engine is not None:
            engine.cache.entries.clear()  # (CastCache.clear)

    def __del__(self):
        if getattr(self, "phase", None) == self.OPEN:  # entered, never exited, dropped: as a generator's finally
            self._leave()


def _steady_state(session, optimizers, loss_id, model, delay_unscale, delay_overflow_check):
    """The one optimizer's state when this block may take the steady path (see :class:`_Block`), else None.

    It holds for a block naming the session's only optimizer by itself (no other optimizer's grads to watch),
    with an existing ``loss_id`` and no ``model``, ``delay_unscale`` or ``delay_overflow_check``, that optimizer
    without two-copy masters and not inside another block, in a single process outside DDP ``no_sync()`` and
    FSDP2, once the session's one-time master check ran. Pending, set-aside or foreign grads, a doomed step, a
    closure's block: ``before_backward``, ``after_backward`` and ``finish_step`` handle those themselves."""
    if model is not None or delay_unscale or delay_overflow_check or type(loss_id) is not int:
        return None
    scaling, parallel = session.scaling, session.parallel
    if len(scaling.opt_states) != 1 or not 0 <= loss_id < len(scaling.scalers):
        return None
    state = scaling.opt_states.get(id(optimizers))
    if state is None or state.optimizer is not optimizers or state.masters is not None or state.in_scale_loss:
        return None
    if parallel.no_sync_depth or parallel.fsdp_groups or not parallel.masters_checked or dist.world() is not None:
        return None
    return state


def _begin(session, loss, optimizers, loss_id, model, delay_unscale):
    """Check the arguments, end a step pause, bring grads already accumulated to the scale.

    Returns ``(scaler, states, delay_unscale)``: inside DDP ``no_sync()`` under master weights the exit is delayed."""
    _check_loss(loss)
    scaler = session.scaling.scaler(loss_id)
    states = [session.scaling.state_for(opt) for opt in _optimizer_list(optimizers)]
    _check_not_nested(states)
    engine = session.casting.engine
    if engine is not None:
        engine.resume_after_step()
        engine.forget_forwards()  # the loss's forward is over (one that raised left its mark)
    parallel = session.parallel
    if parallel.no_sync_depth and any(state.pairs for state in states):
        delay_unscale = True  # inside DDP no_sync(): master grads must wait for the synced backward's reduction
    if parallel.fsdp_groups and distributed.fsdp_accumulating(session, scaler, loss_id):
        delay_unscale = True  # FSDP2 set_requires_gradient_sync(False): the grads are not in param.grad yet
    if model is not None and any(state.pairs for state in states):
        distributed.check_unscale_inside_no_sync(model, delay_unscale)
    if not parallel.masters_checked:
        parallel.masters_checked = True
        distributed.check_not_sharded_since_initialize(parallel.unsharded_models)
        _warn_if_masters_diverged(states)
    in_place = bool(parallel.no_sync_depth)
    for state in states:
        state.before_backward(scaler, in_place)
    return scaler, states, delay_unscale


def _mark_open(states, is_open, ident):
    for state in states:
        state.in_scale_loss = is_open
        if is_open:
            state.busy[ident] = "a scale_loss block"
        else:
            state.busy.pop(ident, None)


def check_idle_elsewhere(session):
    """deinitialize() removes process-wide patches: refuse while another live thread is inside a forward of a
    session model (O1), a scale_loss block or an optimizer step of this session (it would finish half under
    amp_patch and half not: raw dtype errors). A thread that starts one just after this check is not stopped."""
    here, alive = threading.get_ident(), {t.ident: t for t in threading.enumerate()}
    busy = [state.busy for state in session.scaling.opt_states.values()]
    if session.casting.engine is not None:
        busy.append(dict.fromkeys(list(session.casting.engine.forwards), "a forward of a model"))
    for found in busy:
        for ident, what in list(found.items()):
            if ident != here and ident in alive:
                raise UsageError(f"amp_patch.deinitialize() from thread {threading.current_thread().name!r} while "
                                 f"thread {alive[ident].name!r} is inside {what} of this session; the patches "
                                 "are process-wide, so that step would finish half under amp_patch and half not. "
                                 "Stop the training threads (join them) first, then deinitialize()")


def _end(session, scaler, loss_id, states, delay_unscale, loss, delay_overflow_check=False):
    """Unscale (unless delayed), agree on overflow across ranks, update the scaler; drop cached casts."""
    with quiet(session):  # amp_patch's own bookkeeping ops must not run through the casting wrappers
        found_inf = False
        for state in states:
            found_inf |= state.after_backward(scaler, delay_unscale, keep_model_grads=apex_rules(session))
            if delay_unscale:
                state.delayed_losses.append(loss.detach())
        if not delay_unscale:
            found_inf = dist.agree_overflow(found_inf)
            if delay_overflow_check and apex_rules(session):  # the script's update_scale() decides (Apex)
                scaler.deferred_overflow = bool(scaler.deferred_overflow) or found_inf
            else:
                finish_step(session, scaler, loss_id, states, found_inf, loss)
    session.clear_cache()


def _note_grads_written(session, states, others, loss_id):
    """Grads this backward wrote into optimizers it did not name stay scaled: mark them (refused until cleared)."""
    for state, snapshot in others:
        state.note_foreign(snapshot, loss_id)
    _note_own_exit(session, states)


def _note_own_exit(session, states):
    """Inside an enclosing open block, remember what this block left in its own optimizers: that is not foreign
    (noted again once the exit unscaled them and added back what it had set aside)."""
    opt_states = session.scaling.opt_states
    if len(opt_states) == 1:  # (the one optimizer is this block's, and it is no longer open)
        return
    ident = threading.get_ident()
    if any(state.in_scale_loss and state.used_by(ident) for state in session.scaling.opt_states.values()):
        for state in states:
            state.own_exit = state.grad_snapshot()


def _foreign_snapshots(session, states):
    """Optimizers of the session not passed to this scale_loss: what their grads are before this backward."""
    if len(session.scaling.opt_states) == 1:  # (the one optimizer is this block's)
        return ()
    passed, ident = {id(state) for state in states}, threading.get_ident()
    return [(state, state.grad_snapshot()) for state in session.scaling.opt_states.values()
            if id(state) not in passed and state.used_by(ident)]


def _scaled(loss, scale):
    """``(loss.float() * scale, probe)``; at a scale of 1.0 ``(loss.float(), None)``: ``loss.backward()`` inside the
    block then trains exactly as ``scaled_loss.backward()`` would, so there is nothing to tell apart (Apex yielded
    ``loss.float()`` there too), and the step saves a multiply and two autograd hooks (bfloat16's default)."""
    if scale == 1.0:
        return loss.float(), None
    scaled = loss.float() * scale
    return scaled, _BackwardProbe(loss, scaled)


class _BackwardProbe:
    """Tells ``loss.backward()`` inside the block (grads 1/scale too small) from ``scaled_loss.backward()``."""

    def __init__(self, loss, scaled):
        self.loss_seen = self.scaled_seen = False
        self.handles = [loss.register_hook(self._on_loss), scaled.register_hook(self._on_scaled)]

    def _on_loss(self, grad):
        self.loss_seen = True

    def _on_scaled(self, grad):
        self.scaled_seen = True

    def remove(self):
        for handle in self.handles:
            handle.remove()

    def check(self):
        if self.loss_seen and not self.scaled_seen:
            raise UsageError("loss.backward() ran inside 'with amp_patch.scale_loss(loss, ...) as scaled_loss:', "
                             "so the grads are not scaled and unscaling made them 1/scale too small; call "
                             "scaled_loss.backward() inside the block")


def _warn_if_masters_diverged(states):
    """Once per session: under DDP + master weights, rank 0's half params may have replaced ours."""
    if not any(state.pairs for state in states) or dist.world_size() == 1:
        return
    if masters_out_of_sync():
        warnings.warn("amp_patch: the fp32 master weights do not match the half model weights (DDP broadcast rank "
                      "0's half params at construction, the masters kept this rank's values). Call "
                      "amp_patch.distributed.broadcast_master_params() once after wrapping the model in DDP, or "
                      "build identical weights on every rank.", RuntimeWarning, stacklevel=4)
