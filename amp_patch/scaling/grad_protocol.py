"""The scale_loss protocol's side of :class:`~.optimizer_state.OptimizerState` (a mixin): where the grads stand.

``before_backward`` at a ``scale_loss`` entry and ``after_backward`` at its exit move the ``Grads`` stage
(UNSCALED / SCALED, drawn in :mod:`.optimizer_state`'s docstring); the state owns every field these methods read and
write (``pending``, ``set_aside``, ``kept_model_grads``, ``masters``, ``next_step``, ``stepping``).
"""
import threading

import torch

from .._torch import dist as distributed
from .stages import DOOMED, SCALED, UNSCALED, Scaled
from .unscale import unscale_, unscale_collected_, unscale_into, unscale_usual_

_new = object.__new__


class GradProtocol:
    """``before_backward`` / ``after_backward`` and the unscaling they do (see the module docstring)."""

    def before_backward(self, scaler, in_place=False):
        """Entering scale_loss: bring grads already in ``param.grad`` to ``scaler``'s scale.

        Grads left scaled by another scaler (``delay_unscale``) are unscaled first, into the fp32
        master grads. In a single process half grads (O3), and after an overflow all grads, are
        then set aside (as Apex stashed them): this backward's grads are checked alone, and the
        unscaling exit adds the set-aside ones to the unscaled new ones (a half grad is never
        multiplied up by the scale, which could overflow it). fp32 grads otherwise stay in
        ``param.grad`` and are multiplied by the scale (a power of two: exact), as under DDP (the
        reducer must see the whole accumulation); grads accumulated inside ``no_sync()``
        (``in_place``), which the synced backward must still reduce, are rescaled where they are.
        """
        if self.masters is not None:  # (each guard here skips a call that would do nothing: every iteration)
            self.masters.sync_groups()
        if threading.get_ident() not in self.threads:
            self.claim()
        if self.kept_model_grads:
            self._drop_kept_model_grads()
        self.forgotten.scaled = True  # (ForgottenScaleLoss.note_scaled)
        if self.foreign is not None:
            self.check_foreign("scale_loss")
        if self.next_step is DOOMED:
            self._pardon()
        pending = self.pending
        if pending is None:
            if self.next_step is DOOMED or scaler.scale != 1.0:  # (else _bring_to has nothing to do)
                self._bring_to(scaler, unreduced=in_place)
            self.pending = Scaled(scaler, in_place)
            return
        # The grads carry pending.scale: the scale their losses had (another optimizer's exit on this scaler may
        # have changed the scaler's since: amp_patch brings them to this loss's scale, where Apex did not).
        if pending.scale == scaler.scale and (pending.scaler is scaler or self.next_step is not DOOMED):
            pending.scaler = scaler  # (another scaler at the same scale: the sum carries it, nothing to rescale;
            return                   # after an overflow the grads are set aside below, as for another scale)
        pending.unreduced |= in_place
        if pending.unreduced:
            pending.inf_seen |= self._rescale_in_place(pending.scale, scaler.scale)
        else:
            pending.inf_seen |= self._unscale(pending.scale)
            self._bring_to(scaler, unreduced=False)
        pending.scaler, pending.scale = scaler, scaler.scale

    def open_block(self, scaler):
        """A steady ``scale_loss`` block opens: :meth:`before_backward` of ``scaler``, its usual case (grads UNSCALED
        at a scale of 1.0 and nothing else to do) in this frame."""
        if (self.pending is None and scaler._scale == 1.0 and self.next_step is not DOOMED and self.masters is None
                and threading.get_ident() in self.threads and not self.kept_model_grads and self.foreign is None):
            self.forgotten.scaled = True  # (ForgottenScaleLoss.note_scaled)
            self.pending = pending = _new(Scaled)  # (Scaled(scaler) without its __init__ frame)
            pending.scaler, pending.scale, pending.inf_seen, pending.unreduced = scaler, 1.0, False, False
        else:
            self.before_backward(scaler, False)

    def close_block(self, scaler, ident):
        """The steady block of thread ``ident`` exits with no exception: the optimizer leaves it, and
        :meth:`after_backward` of the one-owner layout with nothing set aside, outside ``step()`` (the caller's
        conditions: unscale and check its grads in this frame); inf/NaN seen? Grads stay pending until the check
        returns (one that raised is finished by ``step()``, as after :meth:`after_backward`)."""
        self.in_scale_loss = False
        self.busy.pop(ident, None)
        grads = []  # (a loop, not a comprehension: one frame less on every step)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is not None:
                    grads.append(grad)
        # (scaler._scale is pending.scale here: the steady path has one optimizer, so no other exit changed it)
        found = bool(grads) and unscale_usual_(grads, scaler._scale)
        pending, self.pending = self.pending, None
        return found or pending is not None and pending.inf_seen

    @property
    def grads(self):
        """The :class:`~.stages.Grads` stage: SCALED while ``pending`` holds its data."""
        return UNSCALED if self.pending is None else SCALED

    def adopt_scaled(self, scaler):
        """The grads now in param.grad carry ``scaler``'s scale (a backward run outside scale_loss): SCALED(scaler),
        as a scale_loss entry would leave it (attach_optimizers' ``unscale_loss_id``)."""
        if self.pending is None:
            self.pending = Scaled(scaler)
        else:
            self.pending.scaler, self.pending.scale = scaler, scaler.scale

    def _bring_to(self, scaler, unreduced):
        """Unscaled grads in param.grad get ``scaler``'s scale (single process: half grads, and after an overflow
        every grad, are set aside instead, see before_backward)."""
        doomed, scale = self.next_step is DOOMED, scaler.scale
        if (doomed or scale != 1.0) and not unreduced and distributed.world_size() == 1:
            self._set_aside_grads(every=doomed)
        if scale != 1.0:  # at 1.0 (bfloat16's default) there is nothing to multiply
            grads = self._grads()
            if grads:
                rescale(grads, scale)

    def _set_aside_grads(self, every):
        """Set the (unscaled) half grads accumulated so far aside until the unscaling exit (see before_backward),
        and with ``every`` the fp32 ones too: after an overflow this is what keeps an earlier loss's inf from
        making this loss's scaler back off, or skipping other optimizers this loss names (the skipped step drops
        them). fp32 grads otherwise stay and are rescaled, so a param accumulated several times in one backward
        (a reentrant checkpoint) sums in autograd's order. Sparse grads always stay (rescaled)."""
        for p in self._grad_params():
            if p.grad is not None and not p.grad.is_sparse and (every or p.grad.dtype != torch.float32):
                self.set_aside.append((p, p.grad))
                p.grad = None

    def _restore_set_aside(self):
        for p, grad in self.set_aside:
            p.grad = grad if p.grad is None else p.grad.add_(grad)
        self.set_aside = []

    def after_backward(self, scaler, delay_unscale, keep_model_grads=False):
        """Leaving scale_loss: unscale (unless delayed) and return whether grads overflowed. ``keep_model_grads``
        (Apex's API, two-copy layout): the half model grads stay in ``param.grad``, still scaled, as Apex left them
        (its docstring: "the fp16 model grads will remain scaled"); the next entry or ``zero_grad`` drops them."""
        if delay_unscale:
            return False
        pending = self.pending  # (the grads carry pending.scale, their losses' scale, whatever the scaler's now)
        found = self._unscale(scaler.scale if pending is None else pending.scale, keep_model_grads)
        found = found or (pending is not None and pending.inf_seen)
        self.pending = None
        if self.set_aside:
            self._restore_set_aside()
        if found and self.stepping:  # a closure inside step(): the step cannot be skipped any more, so the
            self._zero_grads()       # overflowed grads become zeros and the step is reported skipped
            self.closure_overflow = True
        return found

    def _zero_grads(self):
        grads = [p.grad for p in self._grad_params() if p.grad is not None and not p.grad.is_sparse]
        grads += [m.grad for _, m in self.pairs if m.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def _rescale_in_place(self, old, new):
        """Grads scaled by ``old`` become scaled by ``new`` (scales) without leaving ``param.grad``; inf/NaN seen?"""
        grads = self._grads()
        grads += [model_p.grad for model_p, _ in self.pairs if model_p.grad is not None]
        return bool(unscale_(grads, old / new)) if grads else False

    def _unscale(self, scale, keep_model_grads=False):
        """param grads /= scale in place; half model grads /= scale into the fp32 master grads. found_inf?"""
        grads = self._grads()
        if self.masters is None:  # (every step of the usual loop)
            return unscale_usual_(grads, scale) if grads else False
        found = unscale_collected_(grads, scale) if grads else False
        master_grads, master_outs, masters = [], [], []
        for model_p, master in self.pairs:
            if model_p.grad is not None:
                master_grads.append(model_p.grad)
                master_outs.append(None if self.masters.stale else master.grad)
                masters.append((model_p, master))
        if self.masters is not None:
            self.masters.stale = False
        if master_grads:
            found |= unscale_into(master_grads, master_outs, scale)
            for (model_p, master), g in zip(masters, master_outs):
                if keep_model_grads:
                    self.kept_model_grads.append((model_p, model_p.grad))
                else:
                    model_p.grad = None
                master.grad = g
        return bool(found)

    def _drop_kept_model_grads(self):
        """The half model grads an exit under Apex's API left in place (already in the master grads) go, as Apex's
        next backward cleared them; one a later backward or the user replaced is not ours to drop."""
        for model_p, grad in self.kept_model_grads:
            if model_p.grad is grad:
                model_p.grad = None
        self.kept_model_grads = []


def rescale(grads, factor):
    """Multiply ``grads`` by ``factor`` in place (dense ones in one foreach call)."""
    dense = [g for g in grads if not g.is_sparse]
    if dense:
        torch._foreach_mul_(dense, factor)
    for g in grads:
        if g.is_sparse:
            g.mul_(factor)
