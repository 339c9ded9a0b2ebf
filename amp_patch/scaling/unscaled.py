"""A forgotten ``scale_loss`` with float16: warn once per optimizer.

Under O1, and under O2 where the fp32 params are the only weights, a plain ``loss.backward()`` trains, but
without loss scaling: small float16 grads underflow to zero, an overflow goes unnoticed (no skipped step) and the
loss scale never moves. The session sets ``OptimizerState.unscaled_warning`` to the opt level where that holds
(float16 with a loss scale other than a static 1.0; bfloat16 needs none). ``OptimizerState`` calls
:func:`note_scaled` when a ``scale_loss`` block names the optimizer and :func:`check_step` as its ``step()``
begins; this module owns the two sets that remember which optimizers were scaled since their last step and which
were warned. A step with a closure is not checked: the closure's own ``scale_loss`` runs inside ``step()``.
"""
import logging
import weakref

log = logging.getLogger("amp_patch")

_scaled = weakref.WeakSet()  # optimizer states a scale_loss block named since their last step()
_warned = weakref.WeakSet()  # optimizer states already warned (once each)


def note_scaled(state):
    """A ``scale_loss`` block names ``state``'s optimizer: its grads of this iteration are scaled."""
    _scaled.add(state)


def check_step(state, closure=None):
    """``step()`` begins: warn (once) where a plain backward trains unscaled and grads exist no scale_loss made."""
    scaled = state in _scaled
    _scaled.discard(state)
    level = state.unscaled_warning
    if scaled or closure is not None or not level or state in _warned:
        return
    if not any(p.grad is not None for group in state.optimizer.param_groups for p in group["params"]):
        return
    _warned.add(state)
    log.warning("%s.step() under %s with float16: its grads were not produced inside amp_patch.scale_loss() (a "
                "plain loss.backward()?), so no loss scale applies: the weights train, but small float16 grads "
                "underflow to zero, an overflow skips no step and the loss scale never moves. Run backward inside "
                "'with amp_patch.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()', or use "
                "half_dtype=torch.bfloat16 (warned once per optimizer)", type(state.optimizer).__name__, level)


def warn_into_masters(state):
    """Two-copy O2 (the apex alias; remainder masters): a plain backward's half grads are taken into the fp32
    master grads at a scale of 1, where Apex's O2 silently dropped them; warn once per optimizer."""
    if state in _warned:
        return
    _warned.add(state)
    log.warning("%s.step() under O2: the half model params have grads no amp_patch.scale_loss() block produced (a "
                "plain loss.backward()?); they are applied to the fp32 master weights as a scale_loss at a static "
                "loss scale of 1 would apply them (Apex's O2 silently never applied them): small float16 grads "
                "underflow to zero and an inf/NaN skips the step. Run backward inside 'with amp.scale_loss(loss, "
                "optimizer) as scaled_loss: scaled_loss.backward()' for loss scaling (warned once per optimizer)",
                type(state.optimizer).__name__)
