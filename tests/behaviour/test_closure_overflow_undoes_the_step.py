"""An overflow in the closure of ``optimizer.step(closure)`` leaves the step undone, for every optimizer.

A generator over torch's optimizers (stateful ones: momentum, weight decay, Adam's moments and step counts, LBFGS's
history), a SAM-shaped optimizer (perturbs the weights before its closure, steps an inner ``base_optimizer``) and a
wrapper stepping an inner optimizer, under O1 and O2, float16: a few clean closure steps, then one whose closure
overflows (in its first call, or in a later one for LBFGS), must leave every param, the optimizer's
``state_dict()`` and the inner optimizers' bitwise as they were, and report the step skipped; the next clean step
trains again. Zeroed grads alone (what amp_patch did before) still moved every stateful optimizer. What a step can
change is the whole optimizer object: a Lookahead keeps a step counter and slow weights as its own attributes, and
they are compared too; an attribute that cannot be copied makes the overflow raise, naming it, instead of report
the step skipped. A step skipped for an overflow before it (no closure) hides the grads, which is all torch's
optimizers need; an optimizer of any other class may change more on a step without grads (the Lookahead's counter
and slow weights), so its skipped step is undone the same way.
"""
import threading

import pytest
import torch
from torch.nn import functional as F

import amp_patch
from amp_patch import legacy

HALF = torch.float16


class Sam(torch.optim.Optimizer):
    """The shape of the widely copied SAM (davda54/sam): step(closure) perturbs, runs the closure, restores the
    weights by reassigning ``p.data`` and steps ``base_optimizer`` (built at construction over the same groups)."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([g.norm() for g in grads])) + 1e-12
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * group["rho"] / norm)
        with torch.enable_grad():
            closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()


class Wrapper(torch.optim.Optimizer):
    """An optimizer that steps an inner one (the shape of Lookahead-style wrappers)."""

    def __init__(self, params):
        super().__init__(params, {})
        self.inner = torch.optim.AdamW(self.param_groups, lr=1e-2, weight_decay=0.1)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.inner.step()
        return loss


class Lookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al. 2019) in the shape scripts write it: its own step counter and slow weights."""

    def __init__(self, params, k=2, alpha=0.5):
        super().__init__(params, {})
        self.inner = torch.optim.SGD(self.param_groups, lr=0.1, momentum=0.9)
        self.k, self.alpha, self.counter = k, alpha, 0
        self.slow = [p.detach().clone() for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.inner.step()
        self.counter += 1
        if self.counter % self.k == 0:
            for slow, p in zip(self.slow, [p for g in self.param_groups for p in g["params"]]):
                slow.add_(p - slow, alpha=self.alpha)
                p.copy_(slow)
        return loss


def _subclass_of(base, **options):
    """A user's subclass of a torch optimizer: its own counter and a decoupled decay, then ``super().step()``. Once
    any instance of ``base`` exists, torch runs the step hooks for both classes' ``step`` (nested: one step)."""

    class Subclass(base):
        def __init__(self, params):
            super().__init__(params, **options)
            self.count = 0

        def step(self, closure=None):
            self.count += 1
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.mul_(0.999)
            return super().step(closure)

    def make(params):
        base([torch.zeros(1, requires_grad=True)], **options)  # (torch hooks base.step from now on)
        return Subclass(params)

    return make


OPTIMIZERS = {
    "SGD momentum wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "AdamW amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-2),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "LBFGS": lambda p: torch.optim.LBFGS(p, lr=0.1, max_iter=3, history_size=4),
    "SAM over SGD momentum": lambda p: Sam(p, torch.optim.SGD, lr=0.1, momentum=0.9),
    "wrapper of AdamW": Wrapper,
    "Lookahead over SGD momentum": Lookahead,
    "subclass of SGD momentum": _subclass_of(torch.optim.SGD, lr=0.1, momentum=0.9),
    "subclass of Adam": _subclass_of(torch.optim.Adam, lr=1e-2),
}
_BASE = set(vars(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)))


def _snapshot(model, opt):
    inner = [v for v in vars(opt).values() if isinstance(v, torch.optim.Optimizer) and v is not opt]
    own = [{k: _clone(v) for k, v in vars(o).items() if k not in _BASE and not isinstance(v, torch.optim.Optimizer)}
           for o in [opt, *inner]]
    return ([p.detach().clone() for p in model.parameters()],
            [_clone(o.state_dict()) for o in [opt, *inner]] + own)


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v) for v in tree)
    return tree


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_overflowing_closure_leaves_params_and_optimizer_state_as_they_were(name, level):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    opt = OPTIMIZERS[name](model.parameters())
    model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=HALF, verbosity=0)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    calls = []

    def closure(bad_call=None):
        calls.append(None)
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        if bad_call is not None and len(calls) == bad_call:
            loss = loss * float("inf")
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        return loss

    prime = closure if name.startswith("SAM") else (lambda: None)  # SAM perturbs along grads of a backward before
    for _ in range(2):
        prime()
        opt.step(closure)
    prime()
    before = _snapshot(model, opt)
    bad_calls = [1, 2] if name == "LBFGS" else [1]
    for bad in bad_calls:
        calls.clear()
        opt.step(lambda bad=bad: closure(bad))
        prime()
        assert amp_patch.last_step_skipped(opt), (name, bad)
        params, states = _snapshot(model, opt)
        assert all(torch.equal(p, b) for p, b in zip(params, before[0])), (name, bad, "params moved")
        assert _equal(states, before[1]), (name, bad, "optimizer state moved")
    opt.step(closure)
    assert not amp_patch.last_step_skipped(opt)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before[0]))


NEED_A_CLOSURE = ("LBFGS", "SAM over SGD momentum")


class ClampsGrads(torch.optim.SGD):
    """A user's optimizer reading ``p.grad`` without a None check (it crashed when a skipped step hid the grads)."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.clamp_(-0.5, 0.5)
        return super().step(closure)


class Restless(torch.optim.SGD):
    """A user's optimizer whose step adds a group key, a param group (its first step) and random noise."""

    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.extra = torch.nn.Parameter(torch.zeros(2))

    def step(self, closure=None):
        if self.extra is not None:
            self.add_param_group({"params": [self.extra]})
            self.extra = None
        with torch.no_grad():
            for group in self.param_groups:
                group["total"] = group.get("total", 0.0) + 1.0
                for p in group["params"]:
                    p.add_(torch.randn_like(p), alpha=1e-3)
        return super().step(closure)


SKIPPED = {**{name: make for name, make in OPTIMIZERS.items() if name not in NEED_A_CLOSURE},
           "subclass clamping p.grad": lambda p: ClampsGrads(p, lr=0.1, momentum=0.9),
           "adds a group, a group key and noise": Restless}


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("name", list(SKIPPED))
def test_a_step_skipped_after_an_overflow_leaves_params_and_optimizer_state_as_they_were(name, level):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    opt = SKIPPED[name](model.parameters())
    model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=HALF, verbosity=0, loss_scale=128.0)
    x, y = torch.randn(8, 4), torch.randn(8, 3)

    def step(bad=False):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y) * (float("inf") if bad else 1.0)
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    step(bad=True)  # (a first step skipped: state, groups and keys its first step would make are not made)
    assert amp_patch.last_step_skipped(opt), name
    for _ in range(3):  # (the Lookahead syncs its slow weights on every second step: the skipped one is the 4th)
        step()
    before, rng = _snapshot(model, opt), torch.get_rng_state()
    step(bad=True)
    assert amp_patch.last_step_skipped(opt), name
    assert torch.equal(torch.get_rng_state(), rng), (name, "a skipped step drew random numbers")
    params, states = _snapshot(model, opt)
    assert all(torch.equal(p, b) for p, b in zip(params, before[0])), (name, "params moved")
    assert _equal(states, before[1]), (name, "optimizer state moved")
    step()
    assert not amp_patch.last_step_skipped(opt)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before[0]))


class Locked(Lookahead):
    """Keeps a lock on the object: it cannot be copied, so an overflow's undo cannot be complete."""

    def __init__(self, params):
        super().__init__(params)
        self.lock = threading.Lock()


def test_an_attribute_that_cannot_be_copied_makes_the_overflow_raise_naming_it():
    model = torch.nn.Linear(4, 3)
    opt = Locked(model.parameters())
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=HALF, verbosity=0)
    x = torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        with amp_patch.scale_loss(model(x).float().sum() * float("inf"), opt) as scaled:
            scaled.backward()

    with pytest.raises(amp_patch.UsageError, match=r"cannot put back Locked.lock \(lock\).*not reported skipped"):
        opt.step(closure)
    assert not amp_patch.last_step_skipped(opt)
    assert opt.counter == 0  # what could be copied was put back


class KeepsItsLoss(Lookahead):
    """Keeps the closure's loss (with its graph) and a history list on the object, replaced and appended by step."""

    def __init__(self, params):
        super().__init__(params)
        self.loss, self.history = None, []

    def step(self, closure=None):
        self.loss = super().step(closure)
        self.history.append(float(self.loss))
        return self.loss


def test_attributes_holding_a_loss_with_its_graph_are_put_back():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = KeepsItsLoss(model.parameters())
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=HALF, verbosity=0)
    x = torch.randn(8, 4)

    def closure(bad=False):
        opt.zero_grad()
        loss = model(x).float().pow(2).mean() * (float("inf") if bad else 1.0)
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        return loss

    opt.step(closure)
    loss, history, counter = opt.loss, list(opt.history), opt.counter
    opt.step(lambda: closure(bad=True))
    assert amp_patch.last_step_skipped(opt)
    assert opt.loss is loss and opt.history == history and opt.counter == counter
    amp_patch.deinitialize()


def test_a_skipped_step_that_cannot_be_undone_raises_naming_the_attribute():
    model = torch.nn.Linear(4, 3)
    opt = Locked(model.parameters())
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=HALF, verbosity=0)
    with amp_patch.scale_loss(model(torch.randn(8, 4)).float().sum() * float("inf"), opt) as scaled:
        scaled.backward()
    with pytest.raises(amp_patch.UsageError, match=r"to be skipped.*cannot put back Locked.lock \(lock\)"):
        opt.step()
    assert not amp_patch.last_step_skipped(opt)
    assert opt.counter == 0


def _closure_run(api, loss_scale, pattern, inf_at=None, as_keyword=False):
    """One ``step(closure)`` whose closure runs a block per entry of ``pattern`` (``delay_unscale`` flags)."""
    amp = {"amp_patch": amp_patch, "apex": legacy.amp}[api]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O0", loss_scale=loss_scale, verbosity=0)
    x, t = torch.randn(6, 4), torch.randn(6, 3)

    def closure():
        opt.zero_grad()
        for k, delay in enumerate(pattern):
            loss = ((model(x[k:k + 3]) - t[k:k + 3]) ** 2).mean()
            if k == inf_at:
                loss = loss * float("inf")
            with amp.scale_loss(loss, opt, delay_unscale=delay) as scaled:
                scaled.backward()
        return loss

    try:
        opt.step(closure=closure) if as_keyword else opt.step(closure)
        return model.weight.detach().clone()
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("api", ["amp_patch", "apex"])
@pytest.mark.parametrize("pattern", [(True,), (True, True), (False, True), (True, False)])
def test_a_closure_whose_last_block_delays_unscaling_steps_on_unscaled_grads(api, pattern):
    # the step reads the grads as the closure returns: a delayed block's are unscaled and checked then (they were
    # stepped on multiplied by the loss scale, silently)
    for as_keyword in (False, True):
        assert torch.equal(_closure_run(api, "dynamic", pattern, as_keyword=as_keyword),
                           _closure_run(api, 1.0, pattern, as_keyword=as_keyword)), (pattern, as_keyword)


@pytest.mark.parametrize("api", ["amp_patch", "apex"])
def test_an_overflow_in_a_closures_delayed_block_undoes_the_step(api):
    torch.manual_seed(0)
    before = torch.nn.Linear(4, 3).weight.detach().clone()
    assert torch.equal(_closure_run(api, "dynamic", (False, True), inf_at=1), before)
