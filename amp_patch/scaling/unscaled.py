"""A forgotten ``scale_loss`` under O1 with float16: warn once per optimizer.

O2 refuses a plain ``loss.backward()`` (its half grads never reach the fp32 masters); under O1 the same mistake
trains, silently without loss scaling: small float16 grads underflow to zero, an overflow goes unnoticed (no
skipped step) and the loss scale never moves. ``OptimizerState`` calls :func:`note_scaled` when a
``scale_loss`` block names the optimizer and :func:`check_step` as its ``step()`` begins; this module owns the
two sets that remember which optimizers were scaled since their last step and which were warned.
(bfloat16 needs no loss scaling: no warning.)
"""
import logging
import weakref

import torch

log = logging.getLogger("amp_patch")

_scaled = weakref.WeakSet()  # optimizer states a scale_loss block named since their last step()
_warned = weakref.WeakSet()  # optimizer states already warned (once each)


def note_scaled(state):
    """A ``scale_loss`` block names ``state``'s optimizer: its grads of this iteration are scaled."""
    _scaled.add(state)


def check_step(state, closure=None):
    """``step()`` begins: warn (once) when O1 casts to float16 and grads exist that no scale_loss produced."""
    scaled = state in _scaled
    _scaled.discard(state)
    engine = state.engine
    if scaled or closure is not None or state in _warned or engine is None or engine.half_dtype is not torch.float16:
        return
    if not any(p.grad is not None for group in state.optimizer.param_groups for p in group["params"]):
        return
    _warned.add(state)
    log.warning("%s.step() under O1 with float16: its grads were not produced inside amp_patch.scale_loss() (a "
                "plain loss.backward()?), so no loss scale applies: small float16 grads underflow to zero, an "
                "overflow skips no step and the loss scale never moves. Run backward inside 'with "
                "amp_patch.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()' (warned once per "
                "optimizer)", type(state.optimizer).__name__)
