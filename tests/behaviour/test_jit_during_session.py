"""torch.jit during a session: trace works, script is refused naming the fix.

O1's wrappers never use the cast cache while torch.jit traces (a cast cached by an earlier forward became a graph
constant: "Cannot insert a Tensor that requires grad as a constant"), so ``torch.jit.trace`` records the casts;
``amp_patch.autocast(cache_enabled=False)``, torch's own workaround, is accepted. ``torch.jit.script`` cannot
compile amp_patch's Python hooks (and would compile past the O1 wrappers): it is refused with a UsageError.
"""
import pytest
import torch

import amp_patch

HALF = torch.bfloat16


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.relu(self.lin(x)))


def _session(level):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = amp_patch.initialize(model, opt, opt_level=level, half_dtype=HALF, verbosity=0)
    return model


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_trace_during_a_session_records_the_casts(level):
    model = _session(level)
    x = torch.randn(3, 4)
    eager = model(x)  # (fills O1's cast cache first: the trace must not take a cached cast as a constant)
    traced = torch.jit.trace(model, x)
    assert traced(x).dtype == eager.dtype and torch.equal(traced(x), eager)
    if level == "O1":
        assert eager.dtype is HALF  # the trace holds the casts: it runs them after the session too
        amp_patch.deinitialize()
        assert torch.equal(traced(x), eager)


def test_trace_inside_autocast_with_cache_disabled():
    model = Net()
    x = torch.randn(3, 4)
    with amp_patch.autocast("cpu", dtype=HALF, cache_enabled=False):
        eager = model(x)
        traced = torch.jit.trace(model, x)
        assert torch.equal(traced(x), eager) and eager.dtype is HALF
    with torch.autocast("cpu", dtype=HALF, cache_enabled=False):  # the same code under torch's autocast
        assert model(x).dtype is HALF


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_script_is_refused_naming_trace(level):
    model = _session(level)
    with pytest.raises(amp_patch.UsageError, match=r"torch.jit.script cannot compile.*torch.jit.trace"):
        torch.jit.script(model)
