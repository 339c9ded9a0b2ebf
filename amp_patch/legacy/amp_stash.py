"""Apex's O2 optimizer internals that resume code calls: ``optimizer._amp_stash`` and
``optimizer._lazy_init_maybe_master_weights()`` (NVIDIA's BERT pre-training, on resume and after an overflow).

Apex stored them on each optimizer. Here nothing is stored on the user's optimizer: while an ``apex.amp``
session is open, ``torch.optim.Optimizer`` has the two names (a reversible class patch, removed at
``deinitialize``) and they answer from the session. ``_lazy_init_maybe_master_weights()`` is a no-op (amp_patch
made the masters at ``initialize``); ``_amp_stash`` is a view: ``all_fp16_params`` (the half model params),
``all_fp32_from_fp16_params`` (their fp32 masters), ``all_fp32_from_fp32_params`` (the optimizer's fp32 params
without a master); ``lazy_init_called`` / ``already_patched`` can be set (accepted, nothing to do).

Apex's O2 also replaced each optimizer's ``zero_grad``: the grads of the params it holds were zeroed in place (so
a step that no loss reached still applied momentum and weight decay to its fp32 params, e.g. BatchNorm's) and
only the masters' grads were dropped. ``install`` marks the O2 optimizers' states so (``zero_grads_in_place``),
and the session's ``zero_grad`` guard does the same.
"""
import torch

from ..errors import UsageError
from ..patching.patcher import Patcher
from .unsupported import ApexAttributeError, attribute_error

_SETTABLE = ("lazy_init_called", "already_patched")


class AmpStashView:
    """``optimizer._amp_stash``: Apex's master-weight lists of this optimizer, read from its amp_patch state."""

    def __init__(self, state):
        object.__setattr__(self, "_state", state)

    @property
    def all_fp16_params(self):
        return [p for p, _ in self._state.pairs]

    @property
    def all_fp32_from_fp16_params(self):
        return [m for _, m in self._state.pairs]

    @property
    def all_fp32_from_fp32_params(self):
        masters = {id(m) for _, m in self._state.pairs}
        return [p for g in self._state.optimizer.param_groups for p in g["params"] if id(p) not in masters]

    lazy_init_called = True
    already_patched = False

    def __setattr__(self, name, value):
        if name not in _SETTABLE:
            raise UsageError(f"optimizer._amp_stash.{name} cannot be set in amp_patch (the stash is a view of the "
                             f"session); settable: {', '.join(_SETTABLE)} (accepted, nothing to do)")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise attribute_error(f"amp._amp_stash.{name}")


def _state_of(session, optimizer):
    state = session.scaling.opt_states.get(id(optimizer))
    if state is None or state.optimizer is not optimizer:
        raise ApexAttributeError(f"optimizer._amp_stash of a {type(optimizer).__name__} optimizer amp.initialize "
                                 "was not given", "pass the optimizer to amp.initialize(model, optimizer, ...)")
    return state


def install(session):
    """Give ``torch.optim.Optimizer`` the two names while ``session`` is open; the undo goes on ``session.undo``."""
    added = {"_amp_stash": property(lambda self: AmpStashView(_state_of(session, self))),
             "_lazy_init_maybe_master_weights": lambda self: _state_of(session, self) and None}
    patcher = Patcher()
    session.undo.append(patcher.restore_all)  # first: an interrupt right after an add leaves nothing behind
    for name, value in added.items():
        if name not in vars(torch.optim.Optimizer):  # (a stacked session's are there already)
            patcher.add(torch.optim.Optimizer, name, value)
    for state in session.scaling.opt_states.values():
        state.zero_grads_in_place = bool(state.master_weights)  # Apex's O2 zero_grad (below)
