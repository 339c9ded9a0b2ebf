"""A one-time warning for clipping the model's params while two-copy O2 masters hold the grads.

Under ``master_weights="remainder"``, ``master_rounding="split"`` and the apex alias the grads live on the fp32
masters in the optimizer after ``scale_loss``; ``clip_grad_norm_(model.parameters())`` then finds ``None`` (or
zero) grads and clips nothing. While such a session is open, ``torch.nn.utils.clip_grad_norm_`` and
``clip_grad_value_`` (both in ``torch.nn.utils`` and ``torch.nn.utils.clip_grad``, where scripts reach them at call
time) check, until they have warned once, whether they were given a model param whose master holds a grad. Every
argument is passed through unchanged (a generator of params is listed first, as torch itself does).
"""
import functools
import logging

import torch
from torch.nn import utils as _utils
from torch.nn.utils import clip_grad as _clip_grad

log = logging.getLogger("amp_patch")
_NAMES = ("clip_grad_norm_", "clip_grad_value_")


def install(props, opt_states, patcher):
    """Patch the clipping functions (only where the policy keeps two copies); undone by ``patcher``.
    ``opt_states``: the session's ``{id(optimizer): OptimizerState}``, read at each call."""
    if not props.two_copy:
        return
    warned = []
    masters = _MastersOf(opt_states)

    def make(original):
        name = original.__name__

        @functools.wraps(original)
        def clip(parameters, *args, **kwargs):
            if warned:
                return original(parameters, *args, **kwargs)
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            if _clips_nothing(params, masters.current()):
                warned.append(name)
                log.warning(
                    "torch.nn.utils.%s() got the model's parameters, whose grads are None or zero: under "
                    "master_weights='remainder', master_rounding='split' or the apex alias the grads live on the "
                    "fp32 masters after scale_loss, so this clips nothing. Clip "
                    "amp_patch.master_params(optimizer) instead, or use default O2 (master_weights=True, "
                    "master_rounding='nearest'), whose model params hold the grads (logged once)", name)
            return original(params, *args, **kwargs)
        return clip

    replaced = {}
    for module in (_clip_grad, _utils):
        for name in _NAMES:
            original = vars(module).get(name)
            if original is None:
                continue
            if id(original) not in replaced:  # (the same function in both modules gets the same wrapper)
                replaced[id(original)] = make(original)
            wrapper = replaced[id(original)]
            patcher.install(module, name, lambda _, new=wrapper: new)


class _MastersOf:
    """``{id(model param): master}`` over the session's optimizers, rebuilt when their pairs change."""

    def __init__(self, opt_states):
        self.opt_states, self.count, self.table = opt_states, -1, {}

    def current(self):
        states = list(self.opt_states.values())
        count = sum(len(state.pairs) for state in states)
        if count != self.count:
            self.table = {id(param): master for state in states for param, master in state.pairs}
            self.count = count
        return self.table


def _clips_nothing(params, masters):
    for p in params:
        master = masters.get(id(p))
        if master is not None and master.grad is not None and (p.grad is None or not p.grad.any()):
            return True
    return False
