"""O1 under torch.compile: same output dtypes as eager and no graph break caused by the wrappers."""
import pytest
import torch
from tests_support import SmallNet, run_python

import amp_patch


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_compiled_o1_matches_eager_dtypes_without_graph_breaks(half):
    torch._dynamo.reset()
    # Apex's list: SmallNet's softmax is in its float list (the second output is float32)
    model = amp_patch.initialize(SmallNet(), opt_level="O1", half_dtype=half, op_lists="apex", verbosity=0)
    x = torch.randn(3, 8)
    eager = model(x)
    assert [t.dtype for t in eager] == [half, torch.float32]
    compiled = torch.compile(model, backend="eager")(x)
    assert [t.dtype for t in compiled] == [t.dtype for t in eager]
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    torch._dynamo.reset()


_AFTER_A_PROCESS_GROUP = """
import os, torch, torch.distributed as dist, amp_patch, test_scoped_op_lists as t
# init_process_group clears dynamo's table of torch functions; a compile inside a session then rebuilt it from
# amp_patch's wrappers, and every later session broke the graph at each patched call
dist.init_process_group("gloo", init_method="file://" + os.path.join(os.getcwd(), "store"), rank=0, world_size=1)
dist.destroy_process_group()
for session in range(3):
    model = t._init(t.Net(), {})
    try:
        e = torch._dynamo.explain(model)(t.X)
    finally:
        amp_patch.deinitialize()
        torch._dynamo.reset()
    print("breaks", e.graph_break_count, "graphs", e.graph_count, flush=True)
"""


def test_sessions_after_a_process_group_compile_without_graph_breaks(tmp_path):
    assert run_python(_AFTER_A_PROCESS_GROUP, tmp_path)[:3] == ["breaks 0 graphs 1"] * 3


def test_an_autocast_region_leaves_dynamos_table_of_torch_functions_alone():
    """Rebuilding that table costs ~0.04 s: a region per batch must not drop it on exit."""
    from torch._dynamo import trace_rules

    table = trace_rules.get_torch_obj_rule_map()
    with amp_patch.autocast(dtype=torch.bfloat16):
        torch.mm(torch.ones(2, 2), torch.ones(2, 2))
    assert trace_rules.get_torch_obj_rule_map() is table


class _RegionNet(torch.nn.Module):
    """A casts-off region inside the compiled forward: its mm stays fp32, the other one runs in half."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = torch.mm(self.fc(x), x.t())
        with amp_patch.autocast(enabled=False):
            z = torch.mm(x, x.t())
        return y, z


@pytest.mark.parametrize("ident", ["this torch's", "pre-2.13 dynamo's"])
def test_the_wrappers_thread_guard_compiles_without_breaks_and_keeps_regions(monkeypatch, ident):
    """``if disabled and _get_ident() in disabled``: dynamo before 2.13 broke the graph at every wrapper on
    ``threading.get_ident``; the ident the wrappers use there is a constant of the graph instead. Both
    idents are checked on every torch: no break in SmallNet, and a casts-off region compiled as in eager."""
    from amp_patch.casting import wrappers

    if ident != "this torch's":
        monkeypatch.setattr(wrappers, "_get_ident", wrappers._ident_for_old_dynamo)
    torch._dynamo.reset()
    model = amp_patch.initialize(SmallNet(), opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    explanation = torch._dynamo.explain(model)(torch.randn(3, 8))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    amp_patch.deinitialize()
    torch._dynamo.reset()
    model = amp_patch.initialize(_RegionNet(), opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(3, 4)
    eager = model(x)
    compiled = torch.compile(model, backend="eager")(x)
    assert [t.dtype for t in eager] == [t.dtype for t in compiled] == [torch.bfloat16, torch.float32]
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    torch._dynamo.reset()


def _train(model, opt, x, y, steps=3):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("called_before", [False, True], ids=["fresh", "called-before"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_compiled_model_passed_to_initialize_trains_as_one_compiled_after(level, called_before):
    """``initialize(torch.compile(model), ...)`` sets up the model inside the wrapper and returns the wrapper (it
    failed inside dynamo: O1's autocast state changed while tracing, O2's hooks mutated a traced module)."""
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    results = []
    for compiled_first in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if compiled_first:
            wrapper = torch.compile(model, backend="eager")
            if called_before:
                wrapper(x)
            returned, opt = amp_patch.initialize(wrapper, opt, opt_level=level, half_dtype=torch.bfloat16,
                                                 verbosity=0)
            assert returned is wrapper
        else:
            model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
            returned = torch.compile(model, backend="eager")
        try:
            results.append(_train(returned, opt, x, y))
        finally:
            amp_patch.deinitialize()
    torch._dynamo.reset()
    (losses, params), (ref_losses, ref_params) = results
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(p, r) for p, r in zip(params, ref_params))


class _CompiledInside(torch.nn.Module):
    """An eager forward calling a compiled submodule (``torch.compile(layer)`` kept as an attribute)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
        self.inner = torch.compile(torch.nn.Linear(8, 8), backend="eager")

    def forward(self, x):
        return self.b(torch.relu(self.inner(self.a(x))))


def test_o1_with_a_compiled_submodule_inside_an_eager_forward_casts_as_the_python_engine():
    """The hybrid engine's native region made dynamo refuse the submodule's frame ("Global autocast state changed
    while dynamo tracing"); such a model gets the Python engine, whose casts are the same."""
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    results = []
    for engine in ("hybrid", "python"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _CompiledInside()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0,
                                          cast_engine=engine)
        try:
            results.append(_train(model, opt, x, y))
        finally:
            amp_patch.deinitialize()
    torch._dynamo.reset()
    (losses, params), (ref_losses, ref_params) = results
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(p, r) for p, r in zip(params, ref_params))
