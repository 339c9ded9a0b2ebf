"""``apex.optimizers.FusedLAMB``: Apex's LAMB (global grad-norm clipping, Adam moments, per-tensor trust ratio)."""
import torch

from ....errors import ConfigError, UsageError
from ... import amp_C
from ._base import (
    FusedOptimizer,
    advance_step,
    by_device,
    closure_loss,
    fp32_buffer,
    param_dtype_buffer,
    refuse_amsgrad,
    update_targets,
)


class FusedLAMB(FusedOptimizer):
    """Apex's FusedLAMB. Each step:

    1. the global L2 norm of every grad of every group is taken; when it exceeds ``max_grad_norm`` (read from
       the constructor's defaults, as Apex did) the grads are divided by ``norm / max_grad_norm``;
    2. Adam moments with ``grad_averaging`` ((1-beta1) on the grad, else 1) and ``bias_correction``;
       update = m_hat / (sqrt(v_hat) + eps), weight decay decoupled (``adam_w_mode=True``) or L2;
    3. ``p -= lr * ||p|| / ||update|| * update`` per tensor when ``use_nvlamb`` or the group's weight decay is
       nonzero (and both norms are nonzero), else ``p -= lr * update``.

    State: ``exp_avg``, ``exp_avg_sq`` in the param's dtype, as Apex made them (``torch.zeros_like(p)``): for a
    half param the kernel computes in fp32 and stores the moments back in half, and the update is rounded to the
    param's dtype before its norm and its application (Apex's kernel wrote it into the half grad). The step count
    is ``param_group["step"]``. Unlike Apex's kernel, the grads are left as they were.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0,
                 use_nvlamb=False):
        refuse_amsgrad("FusedLAMB", amsgrad)
        if max_grad_norm is None or not max_grad_norm > 0:
            raise ConfigError(f"FusedLAMB(max_grad_norm={max_grad_norm!r}): the global grad-norm clip must be a "
                              f"positive number; pass max_grad_norm=float('inf') to disable clipping.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, set_grad_none)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb
        self.master_weights = False

    def step(self, closure=None):
        """One LAMB step for every param with a grad; returns ``closure()``'s loss when given one."""
        loss = closure_loss(closure)
        groups = [(group, self._with_grads(group)) for group in self.param_groups]
        grads = [p.grad for _, items in groups for p, _ in items]
        if not grads:
            return loss
        global_norm = self._global_grad_norm(grads)
        for group, items in groups:
            if items:
                self._step_group(group, items, global_norm)
        return loss

    @staticmethod
    def _global_grad_norm(grads):
        devices = {}
        for g in grads:
            devices.setdefault(g.device, []).append(g)
        first = grads[0].device
        partial = [amp_C.multi_tensor_l2norm(0, FusedOptimizer._noop_flag(d), [gs])[0].to(first)
                   for d, gs in devices.items()]
        return torch.linalg.vector_norm(torch.cat(partial)).reshape(1)

    def _step_group(self, group, items, global_norm):
        step = advance_step(group)
        beta1, beta2 = group["betas"]
        for device, pairs in by_device(items).items():
            targets, write_back = update_targets(pairs, self.master_weights)
            buffer = fp32_buffer if self.master_weights else param_dtype_buffer
            lists = [[p.grad for p, _ in pairs], targets, [], []]
            for p, state in pairs:
                lists[2].append(buffer(p, state, "exp_avg"))
                lists[3].append(buffer(p, state, "exp_avg_sq"))
            amp_C.multi_tensor_lamb(0, self._noop_flag(device), lists, group["lr"], beta1, beta2, group["eps"],
                                    step, 1 if group["bias_correction"] else 0, group["weight_decay"],
                                    1 if group["grad_averaging"] else 0, self.adam_w_mode, global_norm.to(device),
                                    self.defaults["max_grad_norm"], self.use_nvlamb)
            write_back()



class FusedMixedPrecisionLamb(FusedLAMB):
    """Apex's FusedMixedPrecisionLamb: :class:`FusedLAMB` whose reduced-precision (fp16/bf16) params are updated
    through fp32 masters kept in their state (``state["master_param"]``) and then cast back. ``step=`` sets the
    starting step count; ``reduced_precision_dtype`` is accepted (the params' own dtype decides). ``step()`` takes
    no ``grad_scaler``: unscale first (``scaler.unscale_(optimizer)``) or use amp_patch's ``scale_loss``."""

    def __init__(self, params, lr=1e-3, step=0, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0,
                 use_nvlamb=False, reduced_precision_dtype=None):
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adam_w_mode=adam_w_mode,
                         grad_averaging=grad_averaging, max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb)
        self.master_weights = True
        self.reduced_precision_dtype = reduced_precision_dtype
        for group in self.param_groups:
            group["step"] = int(step)

    def step(self, closure=None, grad_scaler=None):
        if grad_scaler is not None:
            raise UsageError("FusedMixedPrecisionLamb.step(grad_scaler=...) is not provided: unscale the grads "
                             "first (scaler.unscale_(optimizer), then scaler.step(optimizer)) or train through "
                             "amp_patch.scale_loss")
        return super().step(closure)
