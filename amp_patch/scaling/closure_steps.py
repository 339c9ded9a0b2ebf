"""``optimizer.step(closure)``: an overflow in the closure undoes the whole step.

The closure runs inside ``step()``, after the optimizer may already have changed the weights (SAM perturbs them
before its closure, LBFGS steps between closure calls) and before it applies the update, so the grads cannot be
hidden beforehand as for a plain skipped step. Zeroed grads are not enough either: momentum, weight decay and
Adam's moments and step count still move on zero grads. So a closure step keeps a copy of what a step can change
(:class:`StepSnapshot`) until it ends, and when a closure's backward overflowed the step is put back exactly:

- every param of the optimizer's param groups (the values, in place: a SAM that reassigns ``p.data`` is followed);
- ``optimizer.state``: each param's entries, tensors cloned and containers copied one level (LBFGS's history lists
  are appended to, their tensors are never written in place);
- each param group's hyper-parameters (anything besides ``params``);
- the same for optimizers the optimizer holds as attributes (SAM's ``base_optimizer``, a wrapper's inner optimizer).

The copy costs one pass over the params and the state per closure step (its figure: docs/usage.md, "An overflow
inside an optimizer's closure"); steps without a closure keep nothing.
"""
import copy

import torch


class StepSnapshot:
    """What ``optimizer.step(closure)`` can change, copied as the step begins."""

    def __init__(self, optimizer):
        self.optimizers = [optimizer] + _inner_optimizers(optimizer)
        params = _unique(p for opt in self.optimizers for g in opt.param_groups for p in g["params"])
        self.params = params
        self.values = [p.detach().clone() for p in params]
        self.states = [(opt, {p: _copy_entries(s) for p, s in opt.state.items()}) for opt in self.optimizers]
        self.groups = [(g, {k: _copy_value(v) for k, v in g.items() if k != "params"})
                       for opt in self.optimizers for g in opt.param_groups]

    def restore(self):
        """Put the params, the optimizer state and the groups' hyper-parameters back; the grads go (a skip)."""
        with torch.no_grad():
            for p, value in zip(self.params, self.values):
                p.copy_(value)
                p.grad = None
        for opt, saved in self.states:
            opt.state.clear()
            opt.state.update(saved)
        for group, saved in self.groups:
            group.update(saved)


def _inner_optimizers(optimizer):
    return [v for v in vars(optimizer).values() if isinstance(v, torch.optim.Optimizer) and v is not optimizer]


def _unique(params):
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _copy_entries(entries):
    return {k: _copy_value(v) for k, v in entries.items()} if isinstance(entries, dict) else _copy_value(entries)


def _copy_value(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, dict, set)):
        return copy.copy(value)
    return value
