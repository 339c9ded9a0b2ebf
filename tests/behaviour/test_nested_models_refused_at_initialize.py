"""A model passed to initialize together with one of its own submodules: where the models are cast (O2, O3) each
gets its own input and output casts, so the inner one's fp32 outputs would reach the outer one's half layers (a raw
dtype error at the first forward). initialize refuses it, naming both models and the fix, and leaves them as they
were; O0 and O1 (no model cast) run it."""
import pytest
import torch

import amp_patch
from amp_patch import AmpPatchError


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


CAST_LEVELS = [("O2", {}), ("O2", {"master_weights": "remainder"}), ("O2", {"master_rounding": "split"}),
               ("O2", {"master_weights": False}), ("O3", {})]


@pytest.mark.parametrize("level,extra", CAST_LEVELS)
@pytest.mark.parametrize("inner_first", [False, True])
def test_a_model_with_its_own_submodule_is_refused_naming_both(level, extra, inner_first):
    model = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    models = [model[0], model] if inner_first else [model, model[0]]
    with pytest.raises(AmpPatchError) as info:
        amp_patch.initialize(models, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0, **extra)
    assert isinstance(info.value, (amp_patch.UsageError, amp_patch.ConfigError))
    inner, outer = (0, 1) if inner_first else (1, 0)
    message = str(info.value)
    assert f"models[{inner}] (Linear)" in message and f"models[{outer}] (Sequential)" in message
    assert "pass only the outer model" in message
    assert amp_patch.deinitialize() is None
    assert all(t.dtype is torch.float32 for t in model.state_dict().values())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model._forward_hooks and not model._forward_pre_hooks and not model[0]._forward_hooks
    model(torch.randn(2, 8))  # (no hook left behind)


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_a_model_with_its_own_submodule_runs_where_no_model_is_cast(level):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize([model, model[0]], opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    with amp_patch.scale_loss(model(torch.randn(2, 8)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert model[0](torch.randn(2, 8)).shape == (2, 8)
