"""``apex.parallel.LARC``: Apex's LARC wrapper (layer-wise adaptive rate clipping/scaling) around any optimizer.

Each step, for every param with a grad and nonzero param and grad norms, the local rate is
``trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)``; with ``clip=True`` it is
``min(local / lr, 1)``. The grad becomes ``(g + weight_decay * p) * local`` and the wrapped optimizer steps with
its own weight decay switched off for that step (restored afterwards), as Apex did.

Unlike Apex's plain object, :class:`LARC` is a ``torch.optim.Optimizer`` sharing the wrapped optimizer's
``param_groups`` and ``state`` (the same objects), so it can be passed to ``amp_patch.initialize`` (Apex's amp
special-cased LARC) and to ``FP16_Optimizer``.
"""
import torch

__all__ = ["LARC"]


class LARC(torch.optim.Optimizer):
    """``LARC(optimizer, trust_coefficient=0.02, clip=True, eps=1e-8)``."""

    def __init__(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
        self.optim = None
        super().__init__([p for group in optimizer.param_groups for p in group["params"]], {})
        self.optim = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.trust_coefficient = trust_coefficient
        self.clip = clip
        self.eps = eps

    def add_param_group(self, param_group):
        if self.optim is None:  # torch's __init__ registering the wrapped optimizer's params
            return super().add_param_group(param_group)
        return self.optim.add_param_group(param_group)

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none=set_to_none)

    def __repr__(self):
        return f"LARC({self.optim!r}, trust_coefficient={self.trust_coefficient}, clip={self.clip})"

    def step(self, closure=None):
        """Rescale the grads by the local rates, then step the wrapped optimizer without its weight decay."""
        decays = [group.get("weight_decay", 0) for group in self.param_groups]
        with torch.no_grad():
            for group, decay in zip(self.param_groups, decays):
                group["weight_decay"] = 0
                for p in group["params"]:
                    if p.grad is not None:
                        self._adapt(p, decay, group["lr"])
        try:
            return self.optim.step() if closure is None else self.optim.step(closure)
        finally:
            for group, decay in zip(self.param_groups, decays):
                group["weight_decay"] = decay

    def _adapt(self, p, decay, lr):
        p_norm, g_norm = torch.norm(p), torch.norm(p.grad)
        if p_norm == 0 or g_norm == 0:
            return
        local = self.trust_coefficient * p_norm / (g_norm + p_norm * decay + self.eps)
        if self.clip:
            local = torch.clamp(local / lr, max=1.0)
        p.grad.add_(p, alpha=decay)
        p.grad.mul_(local)
