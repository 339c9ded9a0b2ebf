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
- every other attribute of the optimizer object (what ``step()`` can change is the whole object: a Lookahead's
  step counter and slow weights, a schedule's internal count): deep-copied as the step begins (the params, and
  the optimizers it holds, stay themselves), put back, and one the step added is removed; torch's own bookkeeping
  of ``Optimizer`` (hooks, ``defaults``) is left alone;
- the same for optimizers the optimizer holds as attributes (SAM's ``base_optimizer``, a wrapper's inner optimizer).

An attribute that cannot be copied (a lock, a generator, a handle) cannot be put back: the undo restores the rest
and then raises :class:`~amp_patch.UsageError` naming it, rather than report a step skipped that was not.

The copy costs one pass over the params and the state per closure step (its figure: docs/usage.md, "An overflow
inside an optimizer's closure"); steps without a closure keep nothing.
"""
import copy

import torch

from ..errors import UsageError

#: attributes every torch optimizer has (torch's bookkeeping: hooks, defaults, profiling names), not the step's
_BASE = frozenset(vars(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))) | {"param_groups", "state"}


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
        self.group_lists = [(opt, list(opt.param_groups)) for opt in self.optimizers]  # a group added is removed
        self.rng = _rng_states()
        memo = {id(p): p for p in params}
        memo.update((id(opt), opt) for opt in self.optimizers)
        self.attrs = [(opt, _copy_attrs(opt, memo)) for opt in self.optimizers]

    def restore(self, why="closure"):
        """Put the params, the optimizer state, the groups' hyper-parameters and the optimizer's own attributes
        back; the grads go (a skip). Raises :class:`UsageError` (after the rest) naming the attributes that could
        not be copied (``why``: ``"closure"``, an overflow in the step's closure; ``"skipped"``, a step skipped
        for an earlier overflow)."""
        with torch.no_grad():
            for p, value in zip(self.params, self.values):
                p.copy_(value)
                p.grad = None
        for opt, saved in self.states:
            opt.state.clear()
            opt.state.update(saved)
        for opt, groups in self.group_lists:
            opt.param_groups[:] = groups
        for group, saved in self.groups:
            params = group["params"]
            group.clear()  # (a key the step added goes too)
            group["params"] = params
            group.update(saved)
        if why == "skipped":  # a skipped step draws no random numbers (GradScaler never calls it)
            _set_rng_states(self.rng)
        lost = []
        for opt, (saved, uncopyable) in self.attrs:
            _restore_attrs(opt, saved, uncopyable)
            lost += [f"{type(opt).__name__}.{name} ({type(getattr(opt, name, None)).__name__})" for name in uncopyable]
        if lost:
            name = type(self.optimizers[0]).__name__
            what = (f"an overflow in the closure of {name}.step(closure)" if why == "closure" else
                    f"{name}.step() was to be skipped (an earlier overflow) and ran, to be undone")
            fix = ", or step without a closure (scale_loss around the backward, then step())" * (why == "closure")
            raise UsageError(
                f"{what}: amp_patch put back the params, the optimizer state and the param groups, but cannot put "
                f"back {', '.join(lost)}: it could not be copied as the step began (copy.deepcopy failed), so the "
                "step is not undone completely and is not reported skipped. Make the attribute deep-copyable (or "
                f"keep it off the optimizer object){fix}")


def _rng_states():
    """torch's global generators: the CPU one and, where CUDA is initialized, each device's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_states(states):
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def hiding_grads_skips(optimizer):
    """Whether a step with every grad hidden (None) changes nothing: torch's own optimizers and amp_patch's Apex
    ones skip a param without a grad. Any other optimizer's ``step()`` may change more (a Lookahead's counter and
    slow weights move on a step without grads) or read ``p.grad`` unchecked, so a skipped step of it runs with its
    (non-finite) grads and is undone from a copy, as a closure's."""
    return type(optimizer).__module__.startswith(("torch.optim.", "amp_patch."))


def _copy_attrs(opt, memo):
    """``({name: deep copy}, [names that could not be copied])`` of the optimizer's own attributes."""
    saved, uncopyable = {}, []
    for name, value in vars(opt).items():
        if _not_the_steps(name, value):
            continue
        try:
            saved[name] = (value, _snap(value, memo))
        except Exception:  # noqa: BLE001 - any object may refuse a copy: reported at an overflow
            uncopyable.append(name)
    return saved, uncopyable


def _snap(value, memo):
    """A copy of ``value``: tensors cloned detached (a loss kept with its graph too), params and held optimizers
    themselves, containers rebuilt, anything else deep-copied (which may raise)."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (list, tuple, set):
        return type(value)(_snap(v, memo) for v in value)
    if type(value) is dict:
        return {k: _snap(v, memo) for k, v in value.items()}
    return copy.deepcopy(value, dict(memo))


def _not_the_steps(name, value):
    """torch's bookkeeping, amp_patch's, the optimizers it holds (restored on their own) and models it refers to
    (a step updates their params, which are restored as params)."""
    return (name in _BASE or name.startswith("_amp") or isinstance(value, (torch.optim.Optimizer, torch.nn.Module)))


def _restore_attrs(opt, saved, uncopyable):
    current = vars(opt)
    for name in [n for n in current if n not in saved and n not in uncopyable and not _not_the_steps(n, current[n])]:
        delattr(opt, name)  # added by the step
    for name, (original, value) in saved.items():
        # the object the attribute held is put back, with its contents (whoever holds it sees the undo)
        if isinstance(original, torch.Tensor) and original.shape == value.shape and original.dtype == value.dtype:
            with torch.no_grad():
                original.copy_(value)
            value = original
        elif type(original) is list:
            original[:] = value
            value = original
        elif type(original) is dict:
            original.clear()
            original.update(value)
            value = original
        setattr(opt, name, value)


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
