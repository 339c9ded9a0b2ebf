"""Per-optimizer state: master weights, gradient unscaling and skipped steps.

The user's optimizer keeps its class. amp_patch attaches only removable step
pre/post hooks (the official extension points) and, under master weights,
swaps the half model params in ``param_groups`` for fp32 masters, as Apex did.

Two stages per optimizer (named in :mod:`.stages`), changed only by the transitions named here. Where the grads
stand, ``grads`` (``pending``: the :class:`~.stages.Scaled` data while ``SCALED``, else None)::

    UNSCALED  --scale_loss entry (before_backward)--> SCALED(s)   grads already in param.grad brought to s's scale
    SCALED(s) --entry, same scaler s--> SCALED(s)                  nothing to do
    SCALED(r) --entry, scaler s--> SCALED(s, inf_seen)            r's grads unscaled first (or, unreduced: inside
                                                                   DDP no_sync(), rescaled in place to s's scale)
    SCALED    --exit with delay_unscale--> SCALED                 left scaled; the next exit or step() finishes
    SCALED    --exit (after_backward)--> UNSCALED                 unscaled (two-copy O2: into the fp32 master
                                                                   grads); overflow = found now or inf_seen
    SCALED    --step() (_finish_delayed)--> UNSCALED              a delayed (or raised) exit finished, scaler updated
    any       --zero_grad() (on_zero_grad)--> UNSCALED            the pending scale is forgotten

What the coming step does, ``next_step``::

    READY  --an overflow counted (doom)--> DOOMED                 at an exit (protocol), or step()'s delayed finish
    DOOMED --scale_loss entry finding no grad (_pardon)--> READY  grads cleared since the overflow (model.zero_grad())
    DOOMED --step() (_take_step)--> READY                         the step is skipped
    READY  --step() (_take_step)--> READY                         it runs (two-copy O2: masters copied to the model)
    any    --zero_grad() (on_zero_grad)--> READY

An overflow in a closure's backward inside ``step()`` (``stepping``) cannot skip that step any more: its grads
become zeros for the rest of the step, and when it ends the step is undone from the copy taken as it began
(``scaling/closure_steps.py``) and reported skipped (``closure_overflow``); the next step is not doomed for it.

A skipped step hides every gradient of the optimizer (sets it to None) for the
duration of ``step()``, so no parameter and no optimizer state (momentum, Adam
moments and step counts) changes, and LR schedulers still see a real call.

``optimizer.zero_grad()`` (see ``session.api._guard_zero_grad``) also clears what amp_patch keeps beside the
optimizer's own grads: the half model grads under master weights and the pending scale, so after a failed
batch ``zero_grad()`` forgets it exactly as it would without amp_patch.
"""
import sys
import threading

from .._torch import dist as distributed
from ..errors import UsageError
from ..weights.masters import TwoCopyMasters
from .closure_steps import StepSnapshot, hiding_grads_skips
from .foreign_grads import ForeignGrads
from .forgotten_scale_loss import ForgottenScaleLoss
from .grad_protocol import GradProtocol, rescale
from .stages import READY, NextStepStage
from .state_casts import cast_state_to_params, uncast_state


class OptimizerState(GradProtocol, ForeignGrads, NextStepStage):
    """What amp_patch tracks for one optimizer passed to ``initialize``.

    ``masters``: the two-copy layout's :class:`~amp_patch.weights.masters.TwoCopyMasters` (``master_weights``),
    else None: under the one-owner layout and without masters no master code runs."""

    def __init__(self, optimizer, *, master_weights, fp32_data=None, storage=None, attach=True,
                 unscaled_warning=False):
        self.optimizer = optimizer
        self.master_weights = master_weights
        self.forgotten = ForgottenScaleLoss(unscaled_warning)  # a plain backward where scale_loss was meant
        self.zero_grads_in_place = False  # Apex's O2 zero_grad (the alias): grads zeroed in place, masters' None
        self.stepping = 0  # inside step() (a closure's scale_loss runs there)
        self.step_frame = None  # the frame of torch's step wrapper that ran the outermost pre-hook
        self.closure_overflow = False  # a closure's backward overflowed: its grads were zeroed
        self.snapshot = None  # inside step(closure): what the step can change, as it began (closure_steps.py)
        self.state_casts = []  # existing optimizer state given its param's dtype (scaling/state_casts.py)
        self.masters = TwoCopyMasters(optimizer, storage) if master_weights else None
        self._init_next_step()  # next_step (READY / DOOMED), doomed_by, last_skipped
        self.pending = None  # the Scaled data while the grads are SCALED (see the grads property)
        self.set_aside = []  # (param, unscaled grad) until the unscaling exit (before_backward)
        self.delayed_losses = []  # the losses of exits that left their grads scaled since the last unscale (a
        # skip's cause says "loss" when one is non-finite: session/step_outcome.finish_step)
        self.kept_model_grads = []  # Apex's API: (half model param, grad) an exit left in place (after_backward)
        self.undo_updates = {}  # scaler -> memento before this step's updates (None: an overflow, kept)
        self.engine = None  # the session's casting engine (O1): paused during step()
        self.finish = None  # finish(state, scaler, found_inf): the session's outcome of an unscaling exit, for the
        # grads step() unscales (session/step_outcome.finish_delayed); False (or None here): the update below
        self.in_scale_loss = False  # an open scale_loss block names this optimizer (nesting is refused)
        self.foreign = None  # (loss_id, {id(param): (weakref, version)}): grads another loss's block left scaled
        self.own_exit = None  # grad_snapshot() when the last scale_loss naming this optimizer inside another exited
        self.threads = set()  # idents of the threads that ran scale_loss / step / zero_grad on it (see used_by)
        self.busy = {}  # thread ident -> "scale_loss" / "optimizer.step()" while one is open there (deinitialize)
        self._handles = []
        if attach:
            self.attach(fp32_data)

    def attach(self, fp32_data=None):
        """Put the masters into the optimizer and hook its step (``attach=False`` at construction lets the caller
        register :meth:`restore` first, so that an interrupt anywhere in here is undone)."""
        try:  # a fault while making masters leaves no master in the optimizer
            if self.masters is not None:
                self.masters.attach(fp32_data)
            self.state_casts = cast_state_to_params(self.optimizer)
            self._handles.append(self.optimizer.register_step_pre_hook(self._pre_step))
            self._handles.append(self.optimizer.register_step_post_hook(self._post_step))
        except BaseException:
            self.restore()
            raise

    # -- the masters' views (empty without the two-copy layout) --------------------------------------------
    @property
    def pairs(self):
        """(half model param, fp32 master) of the two-copy layout; () under the others."""
        return self.masters.pairs if self.masters is not None else ()

    @property
    def storage(self):
        return self.masters.storage if self.masters is not None else None

    def masters_by_model_param(self):
        return self.masters.by_model_param() if self.masters is not None else {}

    def public_pairs(self):
        return self.masters.public_pairs() if self.masters is not None else []

    def to_model(self, model_p, public_master):
        return self.masters.to_model(model_p, public_master)

    def out_of_sync(self, model_p, public_master):
        return self.masters.out_of_sync(model_p, public_master)

    def master_params(self):
        self._sync_groups()
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def _sync_groups(self):
        if self.masters is not None:
            self.masters.sync_groups()

    def _any_grad(self):
        return any(p.grad is not None for group in self.optimizer.param_groups for p in group["params"]) or any(
            p.grad is not None for p, _ in self.pairs)

    def _grad_params(self):
        """Params whose .grad backward fills: model params (under masters, the half ones) and fp32 params."""
        groups = self.optimizer.param_groups
        if self.masters is None:
            return [p for group in groups for p in group["params"]]
        masters = self.masters.ids
        return [p for group in groups for p in group["params"] if id(p) not in masters]

    def _grads(self):
        """The grads :meth:`_grad_params` hold now (their ``.grad`` that is not None)."""
        if self.masters is None:  # (every step: one pass)
            return [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        return [p.grad for p in self._grad_params() if p.grad is not None]

    # -- grads written while this optimizer was not passed to scale_loss -------------------------------
    def claim(self):
        """This thread uses the optimizer (scale_loss naming it, step, zero_grad)."""
        ident = threading.get_ident()
        if ident not in self.threads:
            self.threads.add(ident)

    def used_by(self, ident):
        """Whether a backward in thread ``ident`` may write this optimizer's grads as far as the foreign-grads
        check knows: unclaimed, or claimed by that thread. Threads that each train their own optimizer never see
        each other's scale_loss (their grads are their own thread's backward's, not a foreign loss's)."""
        return not self.threads or ident in self.threads

    def note_update(self, scaler, memento, found_inf):
        """``scaler`` was updated for this optimizer's coming step; ``memento`` is its state before."""
        held = self.undo_updates.get(scaler)
        if found_inf:
            self.undo_updates[scaler] = None  # a backoff is news about the scale: kept even if the step never runs
            if held is not None:
                scaler.holders -= 1
        elif scaler not in self.undo_updates:
            self.undo_updates[scaler] = memento
            scaler.holders += 1

    def on_zero_grad(self):
        """``optimizer.zero_grad()`` ran: clear the half model grads too and forget any pending scale.

        The half grads become None even for ``set_to_none=False``: they are amp_patch's intermediate (each
        scale_loss exit moves them into the masters' grads, which the optimizer itself zeroes). Scaler updates
        made for a step that never completed (``step()`` raised, or was never called) are rolled back, except
        backoffs after an overflow, and except where another optimizer of the same loss still holds them (its step
        may come) or completed a step after them (they stand)."""
        ident = threading.get_ident()
        if ident not in self.threads:
            self.claim()
        if self.busy:
            self.busy.pop(ident, None)  # (a step() that raised never ran its post-hook)
        if self.undo_updates:
            for scaler, memento in self.undo_updates.items():
                if memento is not None:
                    scaler.holders -= 1
                    if scaler.holders <= 0:
                        scaler.roll_back(memento)
            self.undo_updates.clear()
        if self.masters is not None:
            for model_p, master in self.masters.pairs:
                model_p.grad = None
                if self.zero_grads_in_place:
                    master.grad = None  # (Apex: "clear the master grads that are independent of model grads")
        self.kept_model_grads = []
        self.pending, self.foreign = None, None
        self.next_step, self.doomed_by = READY, None  # whatever doomed the step went with the grads
        self.set_aside, self.own_exit = [], None
        if self.delayed_losses:
            self.delayed_losses = []

    def _adopt_backward_outside(self):
        """Two-copy masters: half model grads a plain ``loss.backward()`` left go into the master grads as a
        ``scale_loss`` at a static scale of 1 would put them (an inf/NaN skips the step, as it would there), with
        one warning (scaling/forgotten_scale_loss.py)."""
        self.forgotten.warn_into_masters(self.optimizer)
        if self._unscale(1.0):
            self.doom()

    # -- step hooks -----------------------------------------------------------------------------
    def _pre_step(self, optimizer, args, kwargs):
        """torch's step pre-hook. The usual step, in this one frame: no closure, a block named the optimizer since
        its last step, nothing pending, doomed or foreign, no masters, the thread known; the others in
        :meth:`_general_pre_step`."""
        frame = sys._getframe(1)  # torch's step wrapper running the hooks (a step that raised leaves it)
        if (self.stepping or len(args) != 1 or kwargs or self.masters is not None or self.pending is not None
                or self.next_step is not READY or self.foreign is not None or not self.forgotten.scaled):
            return self._general_pre_step(optimizer, args, kwargs, frame)
        ident = threading.get_ident()
        if ident not in self.threads:
            return self._general_pre_step(optimizer, args, kwargs, frame)
        self.step_frame = frame
        self.busy[ident] = "optimizer.step()"
        self.forgotten.scaled = False
        if self.engine is not None:
            self.engine.pause_for_step()
        self.last_skipped, self.stepping, self.snapshot = False, 1, None  # (_take_step of a READY step)

    def _general_pre_step(self, optimizer, args, kwargs, frame):
        """:meth:`_pre_step` of every other step; ``frame``: torch's step wrapper running the hooks."""
        if self.stepping and self._inside_step():  # a subclass's step() calling super().step(): torch runs the
            self.stepping += 1                         # hooks again; it is one step
            return
        self.step_frame = frame
        masters = self.masters
        if masters is not None:
            masters.sync_groups()
            masters.carry_edits()
        ident = threading.get_ident()
        if ident not in self.threads:
            self.claim()
        self.busy[ident] = "optimizer.step()"
        if self.foreign is not None:
            self.check_foreign("optimizer.step()")
        if masters is not None and masters.plain_backward_grads(self.pending, self.kept_model_grads):
            self._adopt_backward_outside()
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
        forgotten = self.forgotten
        if forgotten.scaled:  # (a block named it since the last step: check_step has nothing to say)
            forgotten.scaled = False
        else:
            forgotten.check_step(self.optimizer, closure)
        if self.engine is not None and closure is None:  # a closure runs a forward: keep casting for it
            self.engine.pause_for_step()
        if self.pending is not None:  # the last backward was delayed (or raised): finish it now
            self._finish_delayed(self.pending.scaler)
        skipped = self._take_step()
        self.stepping = 1
        if masters is not None:
            if masters.groups_checked():
                self.set_aside, self.own_exit = [], None
            masters.before_step()
        keep = closure is not None or (skipped and not hiding_grads_skips(optimizer))
        self.snapshot = StepSnapshot(optimizer) if keep else None
        if skipped:
            self.set_aside = []
            if self.snapshot is None:  # torch's optimizers pass over a param without a grad: hiding them skips
                self._drop_grads()
            # (any other optimizer's step runs with its grads, which it may read, and is undone from the copy)
        if closure is not None:
            return self._finishing_closure(args, kwargs, closure)
        return None

    def _finishing_closure(self, args, kwargs, closure):
        """``step(closure)``'s arguments with the closure wrapped (torch's pre-hook may replace them): grads a
        ``delay_unscale`` block inside it left scaled are unscaled and checked as it returns, before the optimizer
        reads them (an overflow there zeroes them and undoes the step, as one in its unscaling exit)."""
        def closure_finishing_delays():
            result = closure()
            if self.pending is not None and self.stepping:
                self._finish_delayed(self.pending.scaler)
            return result

        closure_finishing_delays.__wrapped__ = closure
        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_finishing_delays}
        return (args[0], closure_finishing_delays, *args[2:]), kwargs

    def _drop_grads(self):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        for model_p, _ in self.pairs:
            model_p.grad = None

    def _inside_step(self):
        """Whether the step whose pre-hook ran last is still running in this thread (not one that raised)."""
        frame, caller = self.step_frame, sys._getframe(2)
        while caller is not None:
            if caller is frame:
                return True
            caller = caller.f_back
        return False

    def _finish_delayed(self, scaler):
        """SCALED -> UNSCALED inside step(): unscale, agree on overflow across ranks, then the outcome of an unscaling
        exit (:attr:`finish`: the scaler's update, DOOMED when it says so, the step history's record)."""
        found = distributed.agree_overflow(self.after_backward(scaler, False))
        if self.finish is not None and self.finish(self, scaler, found):
            return
        memento = scaler.memento()
        if scaler.update(found):
            self.doom(by=scaler)
        self.note_update(scaler, memento, found)

    def _post_step(self, optimizer, args, kwargs):
        if self.stepping > 1:  # (an inner step() of a subclass's super().step(): the outermost one finishes)
            self.stepping -= 1
            return
        self.stepping, self.step_frame = 0, None
        self.busy.pop(threading.get_ident(), None)
        if self.undo_updates:  # (the updates this step took stand, for every optimizer of their losses)
            for scaler, memento in self.undo_updates.items():
                scaler.confirmed = scaler.steps
                if memento is not None:
                    scaler.holders -= 1
            self.undo_updates.clear()
        if self.engine is not None:
            self.engine.resume_after_step()
        incomplete = None
        if self.closure_overflow:  # (the scaler backed off already; the next step is not skipped for it)
            if self.snapshot is not None:  # (None: a scale_loss inside another optimizer's step without a closure)
                incomplete = self._undo_step("closure")
            self.last_skipped, self.next_step, self.closure_overflow = incomplete is None, READY, False
        elif self.last_skipped and self.snapshot is not None:  # a skipped step that ran (see _pre_step): undone
            incomplete = self._undo_step("skipped")
            self.last_skipped = incomplete is None
            self._drop_grads()
        self.snapshot = None
        if self.delayed_losses:
            self.delayed_losses = []
        if self.masters is not None:
            self.masters.after_step(self.last_skipped)
        if incomplete is not None:
            raise incomplete

    def _undo_step(self, why):
        """Put back what the step changed; the :class:`UsageError` naming what could not be put back, or None."""
        try:
            self.snapshot.restore(why)
        except UsageError as exc:  # an attribute it could not copy: raised once the step is finished
            return exc
        return None

    # -- teardown -------------------------------------------------------------------------------
    def restore(self):
        """Remove the hooks and put the model params back into param_groups (with the masters' state)."""
        while self._handles:  # removed, then forgotten (an interrupt between the two loses no hook)
            self._handles[-1].remove()
            self._handles.pop()
        if self.masters is not None:  # (a clip after the last step is kept: deinitialize gives the masters)
            self.masters.carry_edits(strict=False)
        uncast_state(self.state_casts)
        if self.pending is not None:  # a delayed or interrupted backward left its grads multiplied by the scale:
            grads = self._grads()  # they are given back unscaled
            if grads:
                rescale(grads, 1.0 / self.pending.scale)
        if self.masters is not None:
            self.masters.restore()

