"""``apex.optimizers.FusedAdam``: Adam / AdamW with Apex's arguments and state layout, on foreach math."""
import torch

from ....errors import UsageError
from ... import amp_C
from ._base import (
    FusedOptimizer,
    advance_step,
    by_device,
    closure_loss,
    fp32_buffer,
    note_no_effect,
    refuse_amsgrad,
    unscale_for_scaler,
    update_targets,
)
from ._legacy_adam import legacy_step


class FusedAdam(FusedOptimizer):
    """Apex's FusedAdam: ``adam_w_mode=True`` (decoupled weight decay, AdamW) is the default.

    Per param state ``exp_avg`` and ``exp_avg_sq`` (fp32 for half params); the step count is
    ``param_group["step"]``; param groups hold ``lr``, ``bias_correction``, ``betas``, ``eps``,
    ``weight_decay``. ``amsgrad=True`` is refused as Apex refused it. ``master_weights=True`` (``use_master``)
    keeps an fp32 master of each half param (``state["master_param"]``) and writes the param from it.
    ``capturable=True`` takes torch's GradScaler as Apex's capturable kernel did (``_step_supports_amp_scaling``):
    ``scaler.step(opt)`` passes the scaler in, and the step unscales the grads in place itself (half grads
    too), or, after an inf/NaN, skips the update and the step count; CUDA-graph capture has no meaning here.

    The pre-October-2019 form (``eps_inside_sqrt=`` / ``max_grad_norm=`` given by keyword, and
    ``step(grads=, output_params=, scale=, grad_norms=)``) runs that version's update
    (:mod:`._legacy_adam`): L2 decay inside the update, eps not bias-corrected, clipping by ``max_grad_norm``.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, master_weights=False,
                 use_master=False, *, eps_inside_sqrt=None, max_grad_norm=None):
        refuse_amsgrad("FusedAdam", amsgrad)
        self.legacy = eps_inside_sqrt is not None or max_grad_norm is not None
        if self.legacy:
            defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                            max_grad_norm=float(max_grad_norm or 0.0), eps_inside_sqrt=bool(eps_inside_sqrt))
            FusedOptimizer.__init__(self, params, defaults, set_grad_none=False)
            self.adam_w_mode, self.capturable, self.master_weights = 0, False, False
            return
        if capturable:  # CUDA-graph capture: none here; the scaler handshake below gives unscale-then-step's numbers
            note_no_effect("FusedAdam", capturable=capturable)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, set_grad_none)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.multi_tensor_adam = amp_C.multi_tensor_adam  # (Apex's attributes; subclasses such as fairseq's
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int)  # FusedAdamV2 call the kernel with them)
        self.capturable = capturable
        self.master_weights = bool(master_weights or use_master)
        if capturable:
            self._step_supports_amp_scaling = True  # torch's GradScaler hands itself to step()

    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, grad_scaler=None):
        """One Adam step for every param with a grad; returns ``closure()``'s loss when given one."""
        if self.legacy:
            loss = closure_loss(closure)
            legacy_step(self, grads, output_params, 1.0 if scale is None else scale, grad_norms)
            return loss
        if any(x is not None for x in (grads, output_params, scale, grad_norms)):
            raise UsageError("FusedAdam.step(grads=/output_params=/scale=/grad_norms=) is the pre-October-2019 "
                             "API: build the optimizer that way too (FusedAdam(..., max_grad_norm=..., "
                             "eps_inside_sqrt=...)), or call step() with no arguments.")
        loss = closure_loss(closure)
        for group in self.param_groups:
            items = self._with_grads(group)
            if not items:
                continue
            devices = by_device(items)
            if self.capturable and not unscale_for_scaler(self, grad_scaler, devices):
                continue
            step = advance_step(group)
            beta1, beta2 = group["betas"]
            for device, pairs in devices.items():
                targets, write_back = update_targets(pairs, self.master_weights)
                lists = [[p.grad for p, _ in pairs], targets,
                         [fp32_buffer(p, s, "exp_avg") for p, s in pairs],
                         [fp32_buffer(p, s, "exp_avg_sq") for p, s in pairs]]
                amp_C.multi_tensor_adam(0, self._noop_flag(device), lists, group["lr"], beta1, beta2,
                                        group["eps"], step, self.adam_w_mode, 1 if group["bias_correction"] else 0,
                                        group["weight_decay"])
                write_back()
        return loss
