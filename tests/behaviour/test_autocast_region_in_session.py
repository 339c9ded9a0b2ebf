"""An ``amp_patch.autocast()`` region inside an O0/O2/O3 session (which casts no functions itself).

The region casts functions as it does with no session (O1 wrappers for the region only), and its exit leaves the
session active: ``scale_loss`` still works and ``deinitialize()`` still undoes everything.
"""
import pytest
import torch
from torch.nn.modules import module as nn_module

import amp_patch
from amp_patch.session import state as _state

LEVELS = ["O0", "O2", "O3"]


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    @amp_patch.autocast("cpu")  # the decorated forward of docs/recipes.md
    def forward(self, x):
        return self.lin(x)


def _hooks():
    return len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)


def _init(level, model=None):
    torch.manual_seed(0)
    model = model or torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp_patch.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)


def _train_step(model, opt):
    x = torch.randn(3, 4, dtype=next(model.parameters()).dtype)
    with amp_patch.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()


def _assert_undone(model, zero_grad, hooks):
    assert _state.current() is None and _state.active_engine() is None
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert torch.optim.Optimizer.zero_grad is zero_grad
    assert _hooks() == hooks


@pytest.mark.parametrize("level", LEVELS)
def test_an_empty_region_leaves_the_session_active(level):
    zero_grad, hooks = torch.optim.Optimizer.zero_grad, _hooks()
    model, opt = _init(level)
    session = _state.current()
    with amp_patch.autocast("cpu"):
        pass
    assert _state.current() is session
    _train_step(model, opt)
    amp_patch.deinitialize()
    _assert_undone(model, zero_grad, hooks)


@pytest.mark.parametrize("level", LEVELS)
def test_a_decorated_forward_leaves_the_session_active(level):
    zero_grad, hooks = torch.optim.Optimizer.zero_grad, _hooks()
    model, opt = _init(level, _Net())
    for _ in range(2):
        _train_step(model, opt)
    amp_patch.deinitialize()
    _assert_undone(model, zero_grad, hooks)


@pytest.mark.parametrize("level", LEVELS)
def test_the_region_casts_functions_as_with_no_session(level):
    _init(level)
    a = torch.randn(2, 2)
    with amp_patch.autocast("cpu"):
        inside = torch.mm(a, a)
    with amp_patch.autocast("cpu"):
        amp_patch.deinitialize()  # twice deinitialized below: the region's engine is not the session's
        assert torch.mm(a, a).dtype is torch.bfloat16
    assert inside.dtype is torch.bfloat16
    assert torch.mm(a, a).dtype is torch.float32 and _state.active_engine() is None
    assert torch.equal(inside, torch.mm(a.bfloat16(), a.bfloat16()))


# --- two optimizers over one param under master weights (each would keep its own master: wrong numbers) ---

def _two_sgd_over_one_model():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)


def test_two_optimizers_over_one_param_are_refused_at_o2_before_anything_changes():
    """The two-copy layout (here master_rounding="split"; also the apex alias) keeps a master per optimizer."""
    zero_grad, hooks = torch.optim.Optimizer.zero_grad, _hooks()
    model, o1, o2 = _two_sgd_over_one_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(amp_patch.ConfigError, match=r"SGD and SGD.*'weight'.*opt_level='O2'.*param groups"):
        amp_patch.initialize(model, [o1, o2], opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
                             master_rounding="split")
    _assert_undone(model, zero_grad, hooks)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert o1.param_groups[0]["params"][0] is model.weight and not o1.state


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_two_optimizers_over_one_param_are_kept_without_masters(level):
    model, o1, o2 = _two_sgd_over_one_model()  # no second copy (O2: the param is the master): as in fp32
    amp_patch.initialize(model, [o1, o2], opt_level=level, half_dtype=torch.bfloat16, verbosity=0)


def test_two_optimizers_over_separate_params_are_accepted_at_o2():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    o1, o2 = torch.optim.SGD([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.1)
    amp_patch.initialize(model, [o1, o2], opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)


@pytest.mark.parametrize("together", [True, False])
def test_attach_optimizers_refuses_an_optimizer_over_an_attached_param(together):
    model, o1, o2 = _two_sgd_over_one_model()
    model = amp_patch.initialize(model, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
                                 master_rounding="split")  # (the two-copy layout: a master per optimizer)
    if not together:
        amp_patch.attach_optimizers(o1)  # its params are the fp32 masters from now on
    with pytest.raises(amp_patch.ConfigError, match=r"two optimizers .*'weight'"):
        amp_patch.attach_optimizers([o1, o2] if together else o2)
    assert len(_state.current().scaling.opt_states) == (0 if together else 1)
