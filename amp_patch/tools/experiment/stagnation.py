"""Lost updates: the share of the weights an optimizer step leaves bitwise unchanged although their gradient is
not zero. With half-precision weights (O3) an update below half the weight's resolution rounds away (bfloat16
keeps 8 significant bits: a weight of 1.0 does not move for an update under 2**-9); a short loss check cannot see
it, the weights simply stop learning. With float32 weights or masters (O0, O1, O2, native) it is near 0.
"""
import torch


class UnchangedByUpdate:
    """While active, the next ``optimizer.step()`` is watched: ``share`` is the fraction of the elements of its
    parameters with a nonzero gradient that the step left bitwise unchanged (None if no step ran, or none had a
    gradient). Hooks on the optimizer only; removed on exit."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.share = None
        self._before = None
        self._handles = []

    def __enter__(self):
        self._handles = [self.optimizer.register_step_pre_hook(self._pre),
                         self.optimizer.register_step_post_hook(self._post)]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False

    def _params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]

    def _pre(self, optimizer, args, kwargs):
        if self._before is None:
            with torch.no_grad():
                self._before = [(p, p.detach().clone(), p.grad != 0) for p in self._params()]

    def _post(self, optimizer, args, kwargs):
        if self._before is None or self.share is not None:
            return
        moved = total = 0
        with torch.no_grad():
            for p, before, nonzero in self._before:
                if p.shape != before.shape:
                    continue
                total += int(nonzero.sum())
                moved += int((nonzero & (p.detach() != before)).sum())
        self._before = None
        self.share = (total - moved) / total if total else None
