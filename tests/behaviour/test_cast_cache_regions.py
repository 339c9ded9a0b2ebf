"""The O1 cast cache serves only regions amp_patch knows.

A forward of a session's model or an ``amp_patch.autocast()`` region uses the cache; anything else (a copy of
the model, a model never passed to initialize, a submodule called directly) casts without caching, so a write
through ``.data`` between two such calls is always seen and nothing is kept alive. Native autocast is the oracle.
"""
import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from tests_support import CountCasts

import amp_patch

BF16 = torch.bfloat16


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


@pytest.fixture
def session():
    model = _net()
    amp_patch.initialize(model, opt_level="O1", half_dtype=BF16, verbosity=0)
    yield model
    amp_patch.deinitialize()


def _native(module, x):
    """torch.autocast's result, with amp_patch's wrappers passed through (casting off in this thread)."""
    with amp_patch.session.state.active_engine().casts_disabled(), torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        return module(x)


def _soup_outputs(module, x, weights):
    got, want = [], []
    for w in weights:
        module[0].weight.data.copy_(w)  # a model soup: load candidate weights in place, evaluate
        with torch.no_grad():
            got.append(module(x))
        want.append(_native(module, x))
    return got, want


@pytest.mark.parametrize("which", ["deepcopy", "fresh"])
def test_a_model_not_passed_to_initialize_sees_each_data_write(session, which):
    soup = copy.deepcopy(session) if which == "deepcopy" else _net()
    x = torch.randn(2, 4)
    weights = [torch.randn(3, 4) for _ in range(3)]
    got, want = _soup_outputs(soup, x, weights)
    assert not torch.equal(got[0], got[1])
    for g, w in zip(got, want):
        assert torch.equal(g, w), "a weight written through .data was served stale from the cast cache"


@pytest.mark.parametrize("write", ["mul_", "assign", "vector_to_parameters"])
def test_a_submodule_called_directly_sees_each_data_write(session, write):
    sub = session[0]
    x = torch.randn(2, 4)
    with torch.no_grad():
        first = sub(x)
        if write == "mul_":
            sub.weight.data.mul_(2)
        elif write == "assign":
            sub.weight.data = sub.weight.data * -1
        else:
            vec = torch.nn.utils.parameters_to_vector(sub.parameters())
            torch.nn.utils.vector_to_parameters(vec * 3, sub.parameters())
        second = sub(x)
    assert not torch.equal(first, second)
    assert torch.equal(second, _native(sub, x))


def test_fresh_layers_evaluated_outside_a_region_are_not_kept_alive(session):
    engine = amp_patch.session.state.active_engine()
    x = torch.randn(1, 8)
    refs = []
    for _ in range(5):  # e.g. evaluating freshly built candidate layers
        layer = torch.nn.Linear(8, 8)
        with torch.no_grad():
            layer(x)
        refs.append(weakref.ref(layer.weight))
        assert len(engine.cache) == 0
    del layer
    gc.collect()
    assert all(r() is None for r in refs), "the cast cache keeps dead weights (and their half copies) alive"


def test_a_parameter_replaced_each_iteration_in_grad_mode_is_not_kept_alive(session):
    engine = amp_patch.session.state.active_engine()
    layer = torch.nn.Linear(8, 8)
    refs = []
    for _ in range(4):
        layer.weight = torch.nn.Parameter(torch.randn(8, 8))
        refs.append(weakref.ref(layer.weight))
        layer(torch.randn(2, 8)).float().sum().backward()
    assert len(engine.cache) == 0
    gc.collect()
    assert all(r() is None for r in refs[:-1])


def _casts(fn):
    with CountCasts() as counter:
        fn()
    return counter.dtypes.count(BF16)


def test_the_cache_still_serves_a_session_forward_and_an_autocast_region(session):
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)

    class Twice(torch.nn.Module):  # a weight used twice in one forward: cast once
        def forward(self, x):
            return F.linear(F.linear(x, w), w)

    def in_region():
        with amp_patch.autocast():
            F.linear(F.linear(x, w), w)

    def outside():
        F.linear(F.linear(x, w), w)

    twice = Twice()
    amp_patch.deinitialize()
    amp_patch.initialize(twice, opt_level="O1", half_dtype=BF16, verbosity=0)
    # forward: x, w once (cached), the inner output is already bf16 -> 2 casts; outside a region w is cast twice
    assert (_casts(lambda: twice(x)), _casts(in_region), _casts(outside)) == (2, 2, 3)


def test_a_data_write_between_a_forward_and_a_region_is_seen(session):
    x = torch.randn(2, 4)
    w = session[0].weight
    with torch.no_grad():
        session(x)
        w.data.copy_(torch.randn(3, 4))
        with amp_patch.autocast():
            got = F.linear(x, w)
    assert torch.equal(got, F.linear(x.to(BF16), w.detach().to(BF16)))


def test_no_casts_are_kept_after_a_forward_returns(session):
    engine = amp_patch.session.state.active_engine()
    with torch.no_grad():
        session(torch.randn(2, 4))
    assert len(engine.cache) == 0


# -- item 5a: a model called twice before one backward -------------------------------------------------------------
def _twice_grads(model, xs):
    loss = model(xs[0]).float().sum() + model(xs[1]).float().pow(2).sum()
    loss.backward()
    return [p.grad for p in model.parameters()]


def test_a_model_called_twice_in_a_standalone_region_matches_native_bitwise():
    """docs/coverage.md: without a session, one autocast() region around both calls casts once, as native."""
    xs = [torch.randn(3, 4), torch.randn(3, 4)]
    with torch.autocast("cpu", dtype=BF16):
        native = _twice_grads(_net(), xs)
    with amp_patch.autocast("cpu", dtype=BF16, op_lists="torch_cpu"):
        ours = _twice_grads(_net(), xs)
    assert all(torch.equal(a, b) for a, b in zip(native, ours))


def test_each_forward_of_a_model_called_twice_matches_native_bitwise(session):
    """In a session each forward casts afresh: the outputs are native's; only the grads' summation order differs."""
    xs = [torch.randn(3, 4), torch.randn(3, 4)]
    outs = [session(x) for x in xs]
    for x, out in zip(xs, outs):
        assert torch.equal(out.detach(), _native(session, x))


# -- item 5b: einsum / tensordot / inner are unlisted in torch_cpu (docs/coverage.md says why) -----------------------
def _entry_cast_matches_native(fn, *shapes):
    args = [torch.randn(s) for s in shapes]
    with torch.autocast("cpu", dtype=BF16):
        native = fn(*args)
    cast = fn(*[a.to(BF16) for a in args])
    return native.dtype == cast.dtype and torch.equal(native.float(), cast.float())


def test_casting_einsum_tensordot_inner_at_entry_cannot_match_native():
    """Guards the decision not to list them: for some shapes casting the inputs at entry differs from native."""
    einsum = torch.einsum
    assert _entry_cast_matches_native(lambda a, b: einsum("ij,jk->ik", a, b), (5, 7), (7, 3))
    assert not _entry_cast_matches_native(lambda a, b: einsum("ijk,jl->il", a, b), (5, 6, 7), (6, 3))
    assert not _entry_cast_matches_native(lambda a, b: einsum("i,j->ij", a, b), (9,), (4,))
    assert not _entry_cast_matches_native(lambda a, b: torch.tensordot(a, b, dims=3), (2, 3, 4), (2, 3, 4))
    assert not _entry_cast_matches_native(torch.inner, (7,), (7,))


def test_einsum_tensordot_inner_run_in_their_input_dtype_under_torch_cpu():
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    with amp_patch.autocast("cpu", dtype=BF16, op_lists="torch_cpu"):
        outs = [torch.einsum("ij,jk->ik", a, b), torch.tensordot(a, b, dims=1), torch.inner(a, b)]
    assert [o.dtype for o in outs] == [torch.float32] * 3
