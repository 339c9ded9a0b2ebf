"""``apex.optimizers.FusedAdagrad``: Adagrad with Apex's arguments (``adagrad_w_mode``), on foreach math."""
from ... import amp_C
from ._base import FusedOptimizer, by_device, closure_loss, param_dtype_buffer


class FusedAdagrad(FusedOptimizer):
    """Apex's FusedAdagrad: ``sum += g*g; p -= lr * (g / (sqrt(sum) + eps))`` with L2 weight decay added to the
    grad, or, with ``adagrad_w_mode=True``, decoupled decay ``+ weight_decay * p`` in the update. State: ``sum``, in
    the param's dtype as Apex made it (``torch.zeros_like(p)``; for a half param computed in fp32, stored in half).
    """

    def __init__(self, params, lr=1e-2, eps=1e-10, weight_decay=0.0, set_grad_none=True, adagrad_w_mode=False):
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay), set_grad_none)
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0

    def step(self, closure=None):
        """One Adagrad step for every param with a grad; returns ``closure()``'s loss when given one."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            for device, pairs in by_device(self._with_grads(group)).items():
                sums = [param_dtype_buffer(p, state, "sum") for p, state in pairs]
                amp_C.multi_tensor_adagrad(0, self._noop_flag(device), [[p.grad for p, _ in pairs],
                                                                        [p for p, _ in pairs], sums],
                                           group["lr"], group["eps"], self.adagrad_w_mode, group["weight_decay"])
        return loss
