"""A forward of an O1 model that raised ends its casting region then and there (torch's always-called forward
hook), as one that returned: the cast caches it held go with it; one cut off by a ``BaseException`` (Ctrl-C in a
notebook: no always-called hook runs) is found gone at the next forward. Left open until the next ``scale_loss``
(an eval loop has none), native autocast's cache kept the first weights' casts, and later forwards silently
computed with them: an eval sweep over checkpoints gave the first checkpoint's outputs for every checkpoint."""
import pytest
import torch
import torch.nn as nn
from tests_support import Interruptible, forward_on_instance

import amp_patch

_native_on = torch._C.is_autocast_enabled


def _model(forward="class"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Interruptible(), nn.Linear(8, 2))
    return forward_on_instance(model) if forward == "instance" else model


@pytest.mark.parametrize("engine", ["hybrid", "python"])
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("cut,forward", [(RuntimeError, "class"), (KeyboardInterrupt, "class"),
                                         (KeyboardInterrupt, "instance")])
def test_an_eval_sweep_after_a_forward_that_raised_sees_each_checkpoint(engine, grad, cut, forward):
    model = _model(forward)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0,
                                      cast_engine=engine)
    try:
        first = {k: v.clone() for k, v in model.state_dict().items()}
        second = {k: v * 2 + 1 for k, v in first.items()}
        model[2].armed = cut is KeyboardInterrupt
        with pytest.raises(cut):
            model(torch.randn(2, 5 if cut is RuntimeError else 4))  # a bad batch, or Ctrl-C
        model[2].armed = False
        if cut is RuntimeError:
            assert not _native_on("cpu")
        x = torch.randn(3, 4)
        got = []
        for state in (first, second, first):
            model.load_state_dict(state)
            with torch.set_grad_enabled(grad):
                got.append(model(x))
        want = []
        for state in (first, second, first):  # the same forwards, none raised before them
            model.load_state_dict(state)
            with torch.set_grad_enabled(grad):
                want.append(model(x))
    finally:
        amp_patch.deinitialize()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], got[1])


def _reference(layer, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return layer(x)


@pytest.mark.parametrize("engine", ["hybrid", "python"])
@pytest.mark.parametrize("change,forward", [("load_state_dict", "class"), ("optimizer_step", "class"),
                                            ("in_place_edit", "class"), ("load_state_dict", "instance"),
                                            ("optimizer_step", "instance")])  # (nothing sees an in-place edit)
def test_a_submodule_called_on_its_own_after_ctrl_c_sees_the_changed_weights(engine, change, forward):
    """Ctrl-C left the forward's casting region open until the model's next forward; a layer called on its own
    before that (no forward of the model: no hook finds the region gone) computed with its weights' casts from
    before a checkpoint load, an optimizer step or an in-place edit. The guard on the model class's forward now
    ends the region as the interrupt unwinds; where it cannot see it (``forward`` set on the instance), a load and
    a step forget the cut-off forward first (an in-place edit under ``no_grad`` is seen by nothing)."""
    model = _model(forward)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0,
                                      cast_engine=engine)
    try:
        x = torch.randn(3, 4)
        model[0](x)
        model[2].armed = True
        with pytest.raises(KeyboardInterrupt):
            model(x)
        model[2].armed = False
        if change == "load_state_dict":
            model.load_state_dict({k: v * 2 + 1 for k, v in model.state_dict().items()})
        elif change == "in_place_edit":
            with torch.no_grad():
                model[0].weight.mul_(2)
        else:
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
        got = model[0](x)
    finally:
        amp_patch.deinitialize()
    assert torch.equal(got, _reference(model[0], x))
