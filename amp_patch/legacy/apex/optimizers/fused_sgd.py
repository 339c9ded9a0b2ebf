"""``apex.optimizers.FusedSGD``: SGD with momentum/Nesterov and Apex's ``wd_after_momentum``, on foreach math."""
import torch
from torch.optim.optimizer import required as _REQUIRED

from ....errors import ConfigError
from ... import amp_C
from ._base import FusedOptimizer, by_device, closure_loss, note_no_effect


class FusedSGD(FusedOptimizer):
    """Apex's FusedSGD: torch.optim.SGD's math (the first step's momentum buffer is the grad), plus
    ``wd_after_momentum=True`` (weight decay added after the momentum update). State: ``momentum_buffer``.
    ``materialize_master_grads`` tuned Apex's O2 fast path (accepted, no effect). ``set_grad_none``
    defaults to False, as in Apex.
    """

    def __init__(self, params, lr=_REQUIRED, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False):
        if lr is not _REQUIRED and lr < 0.0:
            raise ConfigError(f"FusedSGD(lr={lr!r}): the learning rate must be >= 0")
        if momentum < 0.0 or weight_decay < 0.0:
            raise ConfigError(f"FusedSGD(momentum={momentum!r}, weight_decay={weight_decay!r}): both must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigError(f"FusedSGD(nesterov=True, momentum={momentum!r}, dampening={dampening!r}): Nesterov "
                              f"momentum needs momentum > 0 and dampening = 0")
        if not materialize_master_grads:
            note_no_effect("FusedSGD", materialize_master_grads=materialize_master_grads)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov)
        super().__init__(params, defaults, set_grad_none)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads

    def step(self, closure=None):
        """One SGD step for every param with a grad; returns ``closure()``'s loss when given one."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            if group["lr"] is _REQUIRED:
                raise ConfigError("FusedSGD: pass lr=... (it has no default)")
            for device, pairs in by_device(self._with_grads(group)).items():
                self._step_pairs(group, device, pairs)
        return loss

    def _step_pairs(self, group, device, pairs):
        momentum = group["momentum"]
        new = [p for p, s in pairs if "momentum_buffer" not in s]
        old = [p for p, s in pairs if "momentum_buffer" in s]
        for first_run, params in ((True, new), (False, old)):
            if not params:
                continue
            moms = []
            if momentum != 0:
                for p in params:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    moms.append(state["momentum_buffer"])
            amp_C.multi_tensor_sgd(0, self._noop_flag(device), [[p.grad for p in params], params, moms],
                                   group["weight_decay"], momentum, group["dampening"], group["lr"],
                                   group["nesterov"], first_run, self.wd_after_momentum, 1.0)
