"""A call of an O2 model cut off by Ctrl-C (a ``KeyboardInterrupt``: torch runs no always-called hook) leaves its
half copies in the thread's overlay; the next call drops them, and so, before that, does anything reading the
params through ``_parameters.items()``: ``state_dict()`` (the usual ``except KeyboardInterrupt: torch.save(...)``),
``parameters()`` and ``load_state_dict``. A checkpoint saved after the interrupt holds the fp32 params. (The guard
on the model class's forward ends such a call as it unwinds; with ``forward`` set on the instance it cannot, and
the frame checks above are what end it: both are tested.)"""
import pytest
import torch
import torch.nn as nn
from tests_support import Interruptible, forward_on_instance

import amp_patch


def _session(forward="class"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Interruptible(), nn.Linear(8, 2))
    if forward == "instance":  # the guard on the class's forward cannot see the interrupt: the frame checks end it
        forward_on_instance(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)


def _interrupt(model):
    model[1].armed = True
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 4))
    model[1].armed = False


@pytest.fixture(params=["class", "instance"])
def session(request):
    model, opt = _session(request.param)
    yield model, opt
    amp_patch.deinitialize()


def test_state_dict_after_an_interrupt_holds_the_fp32_params(session):
    model, opt = session
    masters = {name: p.detach().clone() for name, p in model.named_parameters()}
    _interrupt(model)
    state = model.state_dict()
    for name, want in masters.items():
        assert state[name].dtype is torch.float32 and torch.equal(state[name], want)


def test_parameters_after_an_interrupt_are_the_optimizers(session):
    model, opt = session
    _interrupt(model)
    assert [id(p) for p in model.parameters()] == [id(p) for p in opt.param_groups[0]["params"]]


def test_a_checkpoint_loaded_after_an_interrupt_is_what_the_next_call_uses(session):
    model, _ = session
    loaded = {name: torch.randn_like(t) for name, t in model.state_dict().items()}  # (not bf16-exact)
    _interrupt(model)
    model.load_state_dict(loaded)
    assert torch.equal(model[2].weight, loaded["2.weight"])
    x = torch.randn(2, 4)
    out = model(x)
    assert model[2].weight.dtype is torch.float32 and torch.equal(model[2].weight, loaded["2.weight"])
    assert out.dtype is torch.float32
