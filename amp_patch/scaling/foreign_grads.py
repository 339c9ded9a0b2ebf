"""Grads another loss's ``scale_loss`` left scaled: noticed after that block, refused where this optimizer would
use them (``scale_loss`` entry, ``step()``). A mixin of :class:`~.optimizer_state.OptimizerState`, which owns the
``foreign`` and ``own_exit`` fields these methods read and write."""
import threading
import weakref

from ..errors import UsageError


class ForeignGrads:
    """``grad_snapshot`` before another loss's backward, ``note_foreign`` after it, ``check_foreign`` before use."""

    def grad_snapshot(self):
        """{id(param): (weakref to grad, version)} of every param backward may write (no tensor math, and no
        reference that would keep a cleared grad alive)."""
        return {id(p): _grad_key(p.grad) for p in self._grad_params() if p.grad is not None}

    def note_foreign(self, snapshot, loss_id):
        """After a scale_loss that did not name this optimizer: remember the grads its backward wrote (not those
        a scale_loss naming it wrote since: ``own_exit``, taken when such a block nested inside this one exits)."""
        if not self.used_by(threading.get_ident()):  # claimed by another thread since the snapshot
            return
        own = self.own_exit or {}
        touched = [(id(p), _grad_key(p.grad)) for p in self._grad_params() if p.grad is not None
                   and not _same(snapshot.get(id(p)), p.grad) and not _same(own.get(id(p)), p.grad)]
        if touched:
            self.foreign = (loss_id, dict(touched))

    def check_foreign(self, where):
        """Refuse to use grads that another loss's scale_loss left multiplied by its loss scale."""
        if self.foreign is None:
            return
        loss_id, touched = self.foreign
        if not any(_same(touched.get(id(p)), p.grad) for p in self._grad_params() if p.grad is not None):
            self.foreign = None
            return
        name = type(self.optimizer).__name__
        raise UsageError(f"{where}: this {name} optimizer's grads were written by the backward of "
                         f"scale_loss(loss, ..., loss_id={loss_id}), which did not name it, so they are still "
                         f"multiplied by the loss scale. Pass this optimizer to that scale_loss call "
                         f"(scale_loss(loss, [opt1, opt2])), or clear its grads (optimizer.zero_grad()) first.")


def _grad_key(grad):
    return weakref.ref(grad), grad._version


def _same(key, grad):
    """Is ``grad`` the very tensor ``key`` recorded, unchanged since?"""
    return key is not None and grad is not None and key[0]() is grad and key[1] == grad._version
