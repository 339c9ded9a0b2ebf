"""The guard ``initialize`` puts on the class ``forward`` of each model passed (a Ctrl-C in it ends the call as a
raise does) touches nothing else: other instances of the class call straight through, classes whose ``forward`` is
inherited, a descriptor, scripted, traced or an fx graph's are left unguarded, each guarded class has its own code
object (dynamo's recompile limit counts per code object), an in-place reload of ``forward`` (IPython's autoreload)
takes effect and outlives deinitialize, and deinitialize puts the original function back."""
import functools
import inspect
import types
from unittest import mock

import pytest
import torch
import torch.nn as nn
from tests_support import Interruptible

import amp_patch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Other(Net):
    def forward(self, x):
        return self.fc(x) * 2


class Inheriting(Net):
    pass


def _session(*models, level="O1"):
    params = [p for m in models for p in m.parameters()]
    amp_patch.initialize(list(models), torch.optim.SGD(params, lr=0.1), opt_level=level, half_dtype=torch.bfloat16,
                         verbosity=0)


def test_deinitialize_puts_the_original_function_back():
    original = vars(Net)["forward"]
    _session(Net())
    assert vars(Net)["forward"] is not original and vars(Net)["forward"].__wrapped__ is original
    amp_patch.deinitialize()
    assert vars(Net)["forward"] is original


def test_introspection_of_a_guarded_forward_shows_the_original():
    class Signed(Net):
        def forward(self, x, y=None, *, z=1):
            """Its own doc."""
            return self.fc(x)

    expected = inspect.getfullargspec(Signed.forward)
    _session(Signed())
    assert inspect.getfullargspec(Signed.forward) == expected
    assert str(inspect.signature(Signed.forward)) == "(self, x, y=None, *, z=1)"
    assert (Signed.forward.__name__, Signed.forward.__doc__) == ("forward", "Its own doc.")


def test_each_guarded_class_has_its_own_code_object():
    _session(Net(), Other())
    assert Net.forward.__code__ is not Other.forward.__code__


def test_other_instances_of_the_class_call_straight_through_and_their_interrupts_touch_no_session():
    torch.manual_seed(0)
    model, bystander = Net(), nn.Sequential(nn.Linear(4, 4), Interruptible())
    _session(model, nn.Sequential(nn.Linear(4, 4)), level="O2")  # (nn.Sequential's forward is guarded)
    x = torch.randn(2, 4)
    bystander[1].armed = True
    with pytest.raises(KeyboardInterrupt):
        bystander(x)
    bystander[1].armed = False
    assert bystander(x).dtype is torch.float32  # (not a model of the session: O2 does not cast it)
    assert model(x).dtype is torch.float32 and model.fc.weight.dtype is torch.float32


def test_an_inherited_forward_is_not_guarded_and_a_patch_of_the_base_takes_effect():
    model = Inheriting()
    _session(model)
    assert "forward" not in vars(Inheriting)
    with mock.patch.object(Net, "forward", lambda self, x: torch.full((1,), 7.0)):
        assert model(torch.randn(2, 4)).item() == 7.0


@pytest.mark.parametrize("kind", ["partialmethod", "staticmethod"])
def test_a_descriptor_forward_is_not_guarded_and_runs(kind):
    def scaled(self, x, factor):
        return self.fc(x) * factor

    forward = (functools.partialmethod(scaled, factor=3.0) if kind == "partialmethod"
               else staticmethod(lambda x: x + 1))
    cls = type(f"Descriptor{kind}", (Net,), {"forward": forward})
    model = cls()
    _session(model)
    assert vars(cls)["forward"] is forward
    assert model(torch.randn(2, 4)).shape == (2, 4)


def test_traced_and_fx_graph_modules_are_not_guarded_and_keep_running():
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    traced, other_traced = torch.jit.trace(Net(), x), torch.jit.trace(Net(), x)
    graph = torch.fx.symbolic_trace(Net())
    before = vars(type(graph)).get("forward")
    _session(graph)
    assert vars(type(graph)).get("forward") is before
    assert graph(x).dtype is torch.bfloat16  # (O1: the linear is cast)
    assert torch.equal(other_traced(x), other_traced(x)) and traced(x).shape == (2, 4)


def test_an_in_place_reload_of_forward_takes_effect_and_outlives_deinitialize():
    """What IPython's ``%autoreload 2`` does when the user edits ``forward``: the class's function gets the new
    code object and defaults in place."""
    cls = type("Reloaded", (Net,), {"forward": lambda self, x: self.fc(x) * 0 + 1})
    model = cls()
    _session(model)
    edited = types.FunctionType((lambda self, x: self.fc(x) * 0 + 2).__code__, globals())
    function = vars(cls)["forward"]
    function.__code__, function.__defaults__, function.__kwdefaults__ = edited.__code__, None, None
    x = torch.randn(1, 4)
    assert model(x).float()[0, 0].item() == 2.0
    amp_patch.deinitialize()
    assert model(x)[0, 0].item() == 2.0
