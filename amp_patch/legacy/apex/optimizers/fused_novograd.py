"""``apex.optimizers.FusedNovoGrad``: NovoGrad (per-tensor second moment) with Apex's arguments and layout."""
import torch

from ....errors import ConfigError, UsageError
from ... import amp_C
from ._base import FusedOptimizer, advance_step, closure_loss, param_dtype_buffer, refuse_amsgrad


class FusedNovoGrad(FusedOptimizer):
    """Apex's FusedNovoGrad.

    The second moment is one number per tensor: the blended grad norm (L2 for ``norm_type=2``, max for
    ``norm_type=0``), stored as Apex did in ``param_group["exp_avg_sq"] = [half params' norms, fp32 params'
    norms]`` (fp32) and initialised from the first step's norms (or zeros with ``init_zero=True``). Per param
    state: ``exp_avg``, in the param's dtype as Apex made it (``torch.zeros_like(p)``; for a half param computed in
    fp32, stored in half). ``reg_inside_moment=True`` puts the normalised grad plus weight decay into the moment;
    the default adds weight decay to the update.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, reg_inside_moment=False, grad_averaging=True, norm_type=2, init_zero=False,
                 set_grad_none=True):
        refuse_amsgrad("FusedNovoGrad", amsgrad)
        if norm_type not in (0, 2):
            raise ConfigError(f"FusedNovoGrad(norm_type={norm_type!r}): allowed: 2 (L2 norm) or 0 (max norm)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, norm_type=norm_type, init_zero=init_zero)
        super().__init__(params, defaults, set_grad_none)
        self.moment_mode = 0 if reg_inside_moment else 1

    def step(self, closure=None):
        """One NovoGrad step for every param with a grad; returns ``closure()``'s loss when given one."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            items = self._with_grads(group)
            if items:
                self._step_group(group, items)
        return loss

    def _step_group(self, group, items):
        if len({p.device for p, _ in items}) > 1:
            raise UsageError("FusedNovoGrad keeps one norm tensor per param group: put params of different "
                             "devices in different param groups")
        step = advance_step(group)
        split = ([(p, s) for p, s in items if p.dtype != torch.float32],
                 [(p, s) for p, s in items if p.dtype == torch.float32])
        if "exp_avg_sq" not in group:
            group["exp_avg_sq"] = [self._initial_norms(group, pairs, items[0][0].device) for pairs in split]
        beta1, beta2 = group["betas"]
        for norms, pairs in zip(group["exp_avg_sq"], split):
            if norms.numel() != len(pairs):
                raise UsageError(f"FusedNovoGrad: {len(pairs)} params of this group have grads now but "
                                 f"{norms.numel()} had them on the first step; the per-tensor norms in "
                                 f"param_group['exp_avg_sq'] need the same params to have grads every step")
            if not pairs:
                continue
            lists = [[p.grad for p, _ in pairs], [p for p, _ in pairs],
                     [param_dtype_buffer(p, s, "exp_avg") for p, s in pairs]]
            amp_C.multi_tensor_novograd(0, self._noop_flag(norms.device), lists, norms, group["lr"], beta1, beta2,
                                        group["eps"], step, 1 if group["bias_correction"] else 0,
                                        group["weight_decay"], 1 if group["grad_averaging"] else 0,
                                        self.moment_mode, group["norm_type"])

    @staticmethod
    def _initial_norms(group, pairs, device):
        if group["init_zero"] or not pairs:
            return torch.zeros(len(pairs), device=device)
        order = 2 if group["norm_type"] == 2 else float("inf")
        return torch.stack(torch._foreach_norm([p.grad for p, _ in pairs], order, dtype=torch.float32))
