"""A forgotten ``scale_loss`` with float16: warn once per optimizer.

Under O1, and under O2 where the fp32 params are the only weights, a plain ``loss.backward()`` trains, but
without loss scaling: small float16 grads underflow to zero, an overflow goes unnoticed (no skipped step) and the
loss scale never moves. The session gives each ``OptimizerState`` a :class:`ForgottenScaleLoss` for the opt level
where that holds (float16 with a loss scale other than a static 1.0; bfloat16 needs none). The state calls
:meth:`~ForgottenScaleLoss.note_scaled` when a ``scale_loss`` block names the optimizer and
:meth:`~ForgottenScaleLoss.check_step` as its ``step()`` begins. A step with a closure is not checked: the closure's
own ``scale_loss`` runs inside ``step()``.
"""
import logging

log = logging.getLogger("amp_patch")


class ForgottenScaleLoss:
    """One optimizer's check: scaled since its last step? warned already?"""

    def __init__(self, level):
        self.level = level  # the opt level where a plain backward trains unscaled, or None/False: never warn
        self.scaled = False  # a scale_loss block named the optimizer since its last step()
        self.warned = False  # warned once already

    def note_scaled(self):
        """A ``scale_loss`` block names the optimizer: its grads of this iteration are scaled."""
        self.scaled = True

    def check_step(self, optimizer, closure=None):
        """``step()`` begins: warn (once) where a plain backward trains unscaled and grads exist no scale_loss
        made."""
        scaled, self.scaled = self.scaled, False
        if scaled or closure is not None or not self.level or self.warned:
            return
        if not any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
            return
        self.warned = True
        log.warning("%s.step() under %s with float16: its grads were not produced inside amp_patch.scale_loss() "
                    "(a plain loss.backward()?), so no loss scale applies: the weights train, but small float16 "
                    "grads underflow to zero, an overflow skips no step and the loss scale never moves. Run "
                    "backward inside 'with amp_patch.scale_loss(loss, optimizer) as scaled_loss: "
                    "scaled_loss.backward()', or use half_dtype=torch.bfloat16 (warned once per optimizer)",
                    type(optimizer).__name__, self.level)
