"""Apex's standalone fp16 loss scalers (``apex.fp16_utils.loss_scaler``), for scripts that drive them by hand.

:class:`LossScaler` is a static scale that never reports an overflow (as in Apex). :class:`DynamicLossScaler`
halves (``scale_factor``) on an overflow, floored at 1, and grows after ``scale_window`` iterations without
one. ``FP16_Optimizer`` does not use these: it runs on amp_patch's own loss scaler.
"""
import math

__all__ = ["LossScaler", "DynamicLossScaler"]


class LossScaler:
    """A static loss scale."""

    def __init__(self, scale=1):
        self.cur_scale = scale

    @property
    def loss_scale(self):
        return self.cur_scale

    def has_overflow(self, params):
        return False

    @staticmethod
    def _has_inf_or_nan(x):
        return False

    def update_scale(self, overflow):
        pass

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss, retain_graph=False):
        (loss * self.loss_scale).backward(retain_graph=retain_graph)


class DynamicLossScaler(LossScaler):
    """Apex's dynamic scale: ``init_scale=2**32``, ``scale_factor=2.0``, ``scale_window=1000``."""

    def __init__(self, init_scale=2 ** 32, scale_factor=2.0, scale_window=1000):
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params):
        """True if any param's grad holds inf/NaN."""
        return any(p.grad is not None and DynamicLossScaler._has_inf_or_nan(p.grad.data) for p in params)

    @staticmethod
    def _has_inf_or_nan(x):
        """Apex's test, called on the class by scripts: the fp32 sum of ``x`` is inf or NaN (one host sync)."""
        total = float(x.float().sum())
        return math.isinf(total) or math.isnan(total)

    def update_scale(self, overflow):
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1
