"""Casting rules of each category, driven by small op-list mappings (fp16 and bf16)."""
import collections

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import amp_patch

HALVES = [torch.float16, torch.bfloat16]
LIST = {
    "half": {"torch": ["mm", "addmm", "cat"], "torch.Tensor": ["mm", "addmm_"],
             "torch.nn.functional": ["linear", "conv2d"]},
    "float": {"torch": ["exp"], "torch.Tensor": ["exp_", "exp"]},
    "promote": {"torch": ["add", "atan2"], "torch.Tensor": ["add_", "__add__", "__iadd__"]},
    "sequence_promote": {"torch": ["stack"]},
}


@pytest.fixture(params=HALVES, ids=["fp16", "bf16"])
def half(request):
    with amp_patch.autocast(half_dtype=request.param, op_lists=LIST):
        yield request.param


def test_half_casts_fp32_and_the_other_16bit_dtype(half):
    other = torch.bfloat16 if half is torch.float16 else torch.float16
    a = torch.randn(2, 2)
    assert torch.mm(a, a).dtype is half
    assert torch.mm(a.to(other), a).dtype is half
    assert a.mm(a).dtype is half


def test_half_leaves_fp64_ints_and_non_tensors_alone(half):
    d = torch.randn(2, 2, dtype=torch.float64)
    assert torch.mm(d, d).dtype is torch.float64
    i = torch.ones(2, 2, dtype=torch.int64)
    assert torch.mm(i, i).dtype is torch.int64
    a = torch.randn(2, 2)
    assert torch.addmm(a, a, a, beta=0.5, alpha=2).dtype is half


def test_half_casts_inside_lists_tuples_and_kwargs(half):
    a = torch.randn(2, 2)
    assert torch.cat([a, a]).dtype is half
    assert torch.cat((a, a.double()), dim=0).dtype is torch.float64  # fp64 untouched -> torch promotes
    assert F.linear(input=a, weight=a, bias=torch.randn(2)).dtype is half


def test_half_passes_scalar_tuples_through_and_casts_tensors_beside_them(half):
    img, w, b = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3), torch.randn(3)
    out = F.conv2d(img, w, b, (2, 1), [1, 1], (1, 1), 1)
    assert out.dtype is half
    with amp_patch.disable_casts():
        assert torch.equal(out, F.conv2d(img.to(half), w.to(half), b.to(half), (2, 1), [1, 1], (1, 1), 1))
    assert torch.cat((torch.randn(2), torch.randn(2)), 0).dtype is half  # a tuple holding tensors is cast


def test_cast_tree_keeps_container_types():
    from amp_patch.casting.wrappers import cast_tree

    Pair = collections.namedtuple("Pair", "x y")
    cast = lambda t: t.half()  # noqa: E731
    out = cast_tree({"a": [torch.ones(1), (torch.ones(1), 3)], "p": Pair(torch.ones(1), None)}, cast)
    assert out["a"][0].dtype is torch.float16 and out["a"][1][0].dtype is torch.float16 and out["a"][1][1] == 3
    assert isinstance(out["p"], Pair) and out["p"].x.dtype is torch.float16 and out["p"].y is None


def test_cast_tree_casts_the_fields_of_a_dataclass_output_and_keeps_its_type():
    import dataclasses

    from amp_patch.casting.wrappers import cast_tree, iter_tensors

    @dataclasses.dataclass(frozen=True)
    class Output:
        logits: torch.Tensor
        extras: dict
        step: int = 0
        cached: object = dataclasses.field(default=None, init=False)

    out = cast_tree(Output(torch.ones(1), {"aux": torch.ones(1)}, step=3), lambda t: t.half())
    assert type(out) is Output and out.step == 3
    assert out.logits.dtype is torch.float16 and out.extras["aux"].dtype is torch.float16
    assert len(list(iter_tensors(out))) == 2
    assert cast_tree(Output, lambda t: t.half()) is Output  # the class itself is not a record


def test_o2_casts_a_dataclass_output_to_fp32():
    import dataclasses

    import amp_patch

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x):
            return Output(self.lin(x))

    model = Net()
    amp_patch.initialize(model, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    try:
        assert model(torch.randn(3, 4)).logits.dtype is torch.float32
    finally:
        amp_patch.deinitialize()


def test_float_casts_both_16bit_dtypes_to_fp32(half):
    assert torch.exp(torch.randn(3).to(half)).dtype is torch.float32
    assert torch.randn(3).to(half).exp().dtype is torch.float32
    assert torch.exp(torch.randn(3, dtype=torch.float64)).dtype is torch.float64


@pytest.mark.parametrize("a,b,expected", [
    (torch.float16, torch.float32, torch.float32),
    (torch.bfloat16, torch.float32, torch.float32),
    (torch.float16, torch.bfloat16, torch.float32),  # native autocast raises here
    (torch.float16, torch.float64, torch.float64),
    (torch.float16, torch.float16, torch.float16),
])
def test_promote_runs_in_the_widest_dtype(a, b, expected):
    with amp_patch.autocast(op_lists=LIST):
        x, y = torch.randn(3).to(a), torch.randn(3).to(b)
        assert torch.atan2(x, y).dtype is expected
        assert torch.add(x, y).dtype is expected
        assert torch.stack([x, y]).dtype is expected
        assert torch.stack(tensors=[x, y]).dtype is expected


def test_promote_beats_zero_dim_type_promotion(half):
    vec, scalar = torch.randn(3).to(half), torch.tensor(2.0)
    assert (vec + scalar).dtype is torch.float32  # plain torch would keep half for a 0-dim fp32 operand
    assert torch.add(vec, 1.5).dtype is half  # python scalars are not tensors: no promotion


def test_inplace_keeps_self_dtype(half):
    h = torch.randn(3).to(half)
    h.add_(torch.randn(3))
    assert h.dtype is half
    h += torch.randn(3)
    assert h.dtype is half
    f = torch.randn(2, 2)
    f.addmm_(torch.randn(2, 2).to(half), torch.randn(2, 2).to(half))
    assert f.dtype is torch.float32


def test_float_inplace_on_half_self_raises(half):
    with pytest.raises(amp_patch.CastError, match="exp_.*float list.*self is"):
        torch.randn(3).to(half).exp_()
    assert torch.randn(3).exp_().dtype is torch.float32


def test_values_equal_cast_then_call(half):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    assert torch.equal(torch.mm(a, b), torch.mm(a.to(half), b.to(half)))


def test_disable_casts_is_reentrant_and_exception_safe(half):
    a = torch.randn(2, 2)
    with amp_patch.disable_casts():
        with amp_patch.disable_casts():
            assert torch.mm(a, a).dtype is torch.float32
        assert torch.mm(a, a).dtype is torch.float32
    with pytest.raises(ZeroDivisionError):
        with amp_patch.disable_casts():
            1 / 0  # noqa: B018 - the division is what raises
    assert torch.mm(a, a).dtype is half


def test_autocast_enabled_false_inside_region_and_decorator():
    a = torch.randn(2, 2)

    @amp_patch.autocast(op_lists=LIST)
    def run():
        with amp_patch.autocast(enabled=False):
            inner = torch.mm(a, a).dtype
        return torch.mm(a, a).dtype, inner

    assert run() == (torch.float16, torch.float32)
    assert torch.mm(a, a).dtype is torch.float32  # region closed: patches gone


def test_disable_casts_is_per_thread(half):
    import threading

    a = torch.randn(2, 2)
    seen = {}
    ready, done = threading.Event(), threading.Event()

    def other():
        ready.wait()
        seen["other"] = torch.mm(a, a).dtype
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with amp_patch.disable_casts():
        ready.set()
        done.wait(10)
        seen["here"] = torch.mm(a, a).dtype
    thread.join()
    assert seen == {"other": half, "here": torch.float32}


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int32]


def _reference_promote(dtypes):
    floats = [d for d in dtypes if d.is_floating_point]
    if len(set(floats)) < 2:
        return None
    widest = floats[0]
    for d in floats[1:]:
        widest = torch.promote_types(widest, d)
    return widest


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(DTYPES), min_size=2, max_size=4), st.sampled_from([torch.float16, torch.bfloat16]))
def test_promote_and_half_rules_against_a_reference(dtypes, half):
    """The args the original receives, for random dtype mixes: promote = widest floating dtype when floating
    dtypes mix (integers untouched); half = fp32 and the other 16-bit dtype cast, fp64/ints untouched."""
    from amp_patch.casting.wrappers import CastCache, half_wrapper, make_to_half, promote_wrapper
    from amp_patch.config.oplist import OpEntry

    seen = []
    ctx = type("Ctx", (), {"disabled": {}, "to_half": staticmethod(make_to_half(half, CastCache()))})()
    entry = OpEntry("test", "op", "promote", "<test>", 0)
    tensors = [torch.ones(2, dtype=d) for d in dtypes]
    promote_wrapper(lambda *a: seen.append([t.dtype for t in a]), entry, ctx)(*tensors)
    widest = _reference_promote(dtypes)
    expected = [widest if (widest is not None and d.is_floating_point) else d for d in dtypes]
    assert seen[-1] == expected
    half_wrapper(lambda *a: seen.append([t.dtype for t in a]), entry, ctx)(*tensors)
    assert seen[-1] == [half if d in (torch.float32, torch.float16, torch.bfloat16) else d for d in dtypes]
