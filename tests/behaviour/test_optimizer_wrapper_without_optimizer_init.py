"""An Optimizer subclass that wraps an inner optimizer without calling ``Optimizer.__init__`` (Lookahead-style) has
none of torch's step hooks, which amp_patch uses to unscale and skip steps: initialize (and attach_optimizers)
refuse it naming the class and both fixes, touching nothing; each fix trains."""
import pytest
import torch

import amp_patch
from amp_patch import AmpPatchError
from amp_patch.patching import registry


class NoInitWrapper(torch.optim.Optimizer):
    def __init__(self, inner):
        self.inner = inner
        self.param_groups, self.defaults, self.state = inner.param_groups, inner.defaults, inner.state

    def step(self, closure=None):
        return self.inner.step(closure)


class InitWrapper(NoInitWrapper):
    def __init__(self, inner):
        torch.optim.Optimizer.__init__(self, inner.param_groups, inner.defaults)  # the fix the message names
        NoInitWrapper.__init__(self, inner)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _train(model, opt, steps=3, stepper=None):
    torch.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        (stepper or opt).step()


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_wrapper_without_optimizer_init_is_refused_naming_the_fix(level):
    model = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    patches = registry.installed()
    with pytest.raises(AmpPatchError) as info:
        amp_patch.initialize(model, NoInitWrapper(inner), opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    assert isinstance(info.value, amp_patch.ConfigError)
    message = str(info.value)
    assert "NoInitWrapper" in message and "Optimizer.__init__" in message
    assert "super().__init__(" in message and "inner optimizer" in message
    assert registry.installed() == patches
    assert not inner._optimizer_step_pre_hooks and not inner._optimizer_step_post_hooks
    assert all(torch.equal(before[k], v) and v.dtype is torch.float32 for k, v in model.state_dict().items())
    amp_patch.initialize(model, inner, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)  # (fix 2)
    before_steps = [p.detach().clone() for p in inner.param_groups[0]["params"]]
    _train(model, inner, stepper=NoInitWrapper(inner))  # (the wrapper built over it steps it: its hooks run)
    assert all(not torch.equal(a, p) for a, p in zip(before_steps, inner.param_groups[0]["params"]))


def test_a_wrapper_without_optimizer_init_is_refused_by_attach_optimizers():
    model = _net()
    amp_patch.initialize(model, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    with pytest.raises(amp_patch.ConfigError, match="NoInitWrapper.*Optimizer.__init__"):
        amp_patch.attach_optimizers(NoInitWrapper(torch.optim.SGD(model.parameters(), lr=0.1)))


def test_a_wrapper_calling_optimizer_init_trains_as_in_fp32():
    ref = _net()
    ref_opt = InitWrapper(torch.optim.SGD(ref.parameters(), lr=0.1))
    _train_fp32(ref, ref_opt)
    model = _net()
    opt = InitWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    _train(model, opt)
    start = _net()
    for (name, got), want, init in zip(model.state_dict().items(), ref.state_dict().values(),
                                       start.state_dict().values()):
        assert not torch.equal(got, init), name  # (the weights moved)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=5e-2)


def _train_fp32(model, opt, steps=3):
    torch.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
