"""Apex's ``FP16_Optimizer`` on amp_patch's O2 pieces: the per-optimizer master-weight state (fp32 masters in
``param_groups``, unscale into fp32 master grads, skipped steps, masters copied into the model after a step)
and amp_patch's :class:`~amp_patch.scaling.scaler.LossScaler`, with the rules of the scaler Apex's used
(``apex.amp.scaler.LossScaler``, not the older ``fp16_utils.DynamicLossScaler``). Apex's printed lines are
printed as Apex printed them (:mod:`amp_patch.legacy.messages`).

Differences from Apex (docs/migration.md): a static ``static_loss_scale`` also skips a step whose grads are
inf/NaN (Apex applied it); ``state_dict()["loss_scaler"]`` is the scaler's state dict, not a pickled object;
a ``closure`` passed to ``step`` is called once before the step (it must call ``optimizer.backward``).
"""
import logging

import torch

from ...._torch import dist as distributed
from ....errors import ConfigError
from ....scaling.optimizer_state import OptimizerState
from ....scaling.scaler import LossScaler
from ....scaling.stages import UNSCALED
from ... import messages

log = logging.getLogger("amp_patch")
__all__ = ["FP16_Optimizer"]
#: Apex's ``amp.scaler.LossScaler`` keywords (what ``dynamic_loss_args`` may hold). ``scale_factor`` is accepted
#: and ignored, as there: the scale halves on an overflow and doubles after ``scale_window`` clean steps.
_DYNAMIC_KEYS = {"init_scale", "scale_factor", "scale_window", "min_loss_scale", "max_loss_scale"}
_DEPRECATED = ("Warning:  FP16_Optimizer is deprecated and dangerous, and will be deleted soon.  "
               "If it still works, you're probably getting lucky.  "
               "For mixed precision, use the documented API https://nvidia.github.io/apex/amp.html, with opt_level=O1.")


def _make_scaler(static_loss_scale, dynamic_loss_scale, dynamic_loss_args):
    """Apex's ``LossScaler("dynamic", **dynamic_loss_args)``: starts at ``min(init_scale, max_loss_scale)``
    (2**16, 2**24), halves on an overflow (floored at ``min_loss_scale``, none by default), doubles after
    ``scale_window`` (2000) clean steps, capped at ``max_loss_scale``."""
    if not dynamic_loss_scale:
        if dynamic_loss_args:
            raise ConfigError("FP16_Optimizer(dynamic_loss_args=...) needs dynamic_loss_scale=True")
        return LossScaler(static_loss_scale)
    args = dict(dynamic_loss_args or {})
    unknown = set(args) - _DYNAMIC_KEYS
    if unknown:
        raise ConfigError(f"FP16_Optimizer(dynamic_loss_args={dynamic_loss_args!r}): unknown keys {sorted(unknown)}; "
                          f"allowed: {sorted(_DYNAMIC_KEYS)}")
    top = args.get("max_loss_scale", 2.0 ** 24)
    return LossScaler("dynamic", init_scale=min(args.get("init_scale", 2.0 ** 16), top),
                      min_loss_scale=args.get("min_loss_scale") or None, max_loss_scale=top,
                      growth_interval=args.get("scale_window", 2000))


class FP16_Optimizer:  # noqa: N801 - Apex's name
    """Wraps ``init_optimizer`` (built on the half model's params): fp32 masters, loss scaling, skipped steps.

    Use as Apex documented: ``optimizer.backward(loss)`` instead of ``loss.backward()``, then optionally
    ``optimizer.clip_master_grads(max_norm)``, then ``optimizer.step()``. ``overflow`` says whether the last
    backward overflowed (that step is skipped); ``loss_scale`` is the current scale.
    """

    def __init__(self, init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False, dynamic_loss_args=None,
                 verbose=True):
        messages.maybe_print(_DEPRECATED, 1)  # Apex printed it unconditionally
        self.optimizer = init_optimizer
        self.verbose = verbose
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.loss_scaler = _make_scaler(static_loss_scale, dynamic_loss_scale, dynamic_loss_args)
        self._masters = OptimizerState(init_optimizer, master_weights=True)
        self.overflow = False
        self.first_closure_call_this_step = True
        master_of = self._masters.masters_by_model_param()
        self.fp16_groups, self.fp32_from_fp16_groups, self.fp32_from_fp32_groups = [], [], []
        model_of = {id(m): p for p, m in self._masters.pairs}
        for group in init_optimizer.param_groups:
            halves = [model_of[id(p)] for p in group["params"] if id(p) in model_of]
            self.fp16_groups.append(halves)
            self.fp32_from_fp16_groups.append([master_of[id(p)] for p in halves])
            self.fp32_from_fp32_groups.append([p for p in group["params"] if id(p) not in model_of])
        self._print_groups(model_of)

    def maybe_print(self, msg):
        """Apex's: print ``msg`` when built with ``verbose=True``."""
        messages.maybe_print(msg, int(bool(self.verbose)))

    def _print_groups(self, model_of):
        """Apex's ``verbose`` lines: each param group, then each trainable param's type and size."""
        for i, group in enumerate(self.optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {i}:")
            for param in group["params"]:
                param = model_of.get(id(param), param)
                if param.requires_grad:
                    self.maybe_print(f"FP16_Optimizer received {param.type()} with {param.size()}")

    # -- the training step -----------------------------------------------------------------------------
    def backward(self, loss, update_master_grads=True, retain_graph=False):
        """``(loss.float() * loss_scale).backward()``; then (by default) :meth:`update_master_grads`."""
        self._masters.before_backward(self.loss_scaler)
        (loss.float() * self.loss_scaler.scale).backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self):
        """Unscale the model grads into the fp32 master grads; an inf/NaN sets ``overflow`` (the step is skipped)."""
        if self._masters.grads is UNSCALED:
            return
        found = distributed.agree_overflow(self._masters.after_backward(self.loss_scaler, False))
        skip = self.loss_scaler.update(found)
        self.overflow = skip
        if skip:
            self._masters.doom()

    def clip_master_grads(self, max_norm, norm_type=2):
        """Clip the fp32 master grads to ``max_norm``; returns their total norm (-1 when the step overflowed)."""
        self.update_master_grads()
        if self.overflow:
            return -1
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def step(self, closure=None):
        """Step the wrapped optimizer on the masters (skipped after an overflow) and copy them into the model."""
        loss = closure() if closure is not None else None
        self.update_master_grads()
        self.optimizer.step()  # (skipped after an overflow)
        self.first_closure_call_this_step = True
        if self.overflow:  # Apex's line, printed by the skipped step (every rank)
            messages.maybe_print(f"Gradient overflow.  Skipping step, reducing loss scale to {self.loss_scale}",
                                 messages.amp_state_verbosity())
            return None
        return loss

    def zero_grad(self, set_grads_to_None=False):  # noqa: N803 - Apex's name
        """Zero (or drop) the fp32 master grads and the model's half grads."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        params += [p for group in self.fp16_groups for p in group]
        for p in params:
            if set_grads_to_None:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()

    # -- scale, state and checkpoints ------------------------------------------------------------------
    @property
    def loss_scale(self):
        return self.loss_scaler.scale

    @loss_scale.setter
    def loss_scale(self, value):
        state = self.loss_scaler.state_dict()
        state["loss_scale"] = value
        self.loss_scaler.load_state_dict(state)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    def _master_params_to_model_params(self):
        with torch.no_grad():
            for model_p, master in self._masters.pairs:
                model_p.copy_(master)

    def _model_params_to_master_params(self):
        with torch.no_grad():
            for model_p, master in self._masters.pairs:
                master.copy_(model_p)

    def state_dict(self):
        """Apex's keys: loss_scaler (the scaler's state dict), dynamic_loss_scale, overflow,
        first_closure_call_this_step, optimizer_state_dict, fp32_from_fp16 (the masters, per group)."""
        return {"loss_scaler": self.loss_scaler.state_dict(), "dynamic_loss_scale": self.dynamic_loss_scale,
                "overflow": self.overflow, "first_closure_call_this_step": self.first_closure_call_this_step,
                "optimizer_state_dict": self.optimizer.state_dict(),
                "fp32_from_fp16": [[m.detach().clone() for m in group] for group in self.fp32_from_fp16_groups]}

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output: scaler, optimizer state, fp32 masters (and the model from them)."""
        if bool(state_dict["dynamic_loss_scale"]) != self.dynamic_loss_scale:
            raise ConfigError(f"FP16_Optimizer.load_state_dict: the checkpoint has dynamic_loss_scale="
                              f"{state_dict['dynamic_loss_scale']!r} but this optimizer was built with "
                              f"{self.dynamic_loss_scale!r}; build it with the same setting")
        scaler = state_dict["loss_scaler"]
        if not isinstance(scaler, dict):  # a pickled Apex scaler object (amp.scaler's, or fp16_utils' older one)
            scale = getattr(scaler, "_loss_scale", getattr(scaler, "cur_scale", None))
            scaler = {"loss_scale": self.loss_scale if scale is None else scale,
                      "unskipped": getattr(scaler, "_unskipped", 0)}
        self.loss_scaler.load_state_dict(scaler)
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for current, saved in zip(self.fp32_from_fp16_groups, state_dict["fp32_from_fp16"]):
                for master, value in zip(current, saved):
                    master.copy_(value)
        self._master_params_to_model_params()

    def __repr__(self):
        return f"FP16_Optimizer({self.optimizer!r}, loss_scale={self.loss_scale!r})"
