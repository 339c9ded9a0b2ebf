"""``cast_model_outputs`` casts the model's outputs at every opt level, O1 included, as Apex's patched forward did.

Under the apex alias the casts of the model's inputs and outputs follow Apex's ``to_type``: every floating tensor,
float64 included. amp_patch's own API leaves float64 alone.
"""
import collections

import pytest
import torch

import amp_patch
from amp_patch.legacy import amp

Pair = collections.namedtuple("Pair", "a b")


class Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 2)

    def forward(self, x):
        y = self.l(x)
        return {"y": y, "rest": [y, (y, Pair(y, torch.arange(2)))], "n": 3}


def _model_and_opt():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


@pytest.mark.parametrize("api", [amp_patch, amp], ids=["amp_patch", "apex_alias"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_o1_casts_model_outputs_to_cast_model_outputs(api, out_dtype):
    m, opt = _model_and_opt()
    m, opt = api.initialize(m, opt, opt_level="O1", cast_model_outputs=out_dtype, verbosity=0)
    out = m(torch.randn(3, 4))
    assert out.dtype is out_dtype  # (the O1 linear alone gives float16)
    assert m.weight.dtype is torch.float32  # the model itself is left fp32


def test_o1_without_cast_model_outputs_leaves_outputs_half():
    m, opt = _model_and_opt()
    m, opt = amp.initialize(m, opt, opt_level="O1", verbosity=0)
    assert m(torch.randn(3, 4)).dtype is torch.float16


def test_o1_output_cast_reaches_nested_containers_and_keeps_the_rest():
    torch.manual_seed(0)
    m = Nested()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = amp.initialize(m, opt, opt_level="O1", cast_model_outputs=torch.float32, verbosity=0)
    out = m(torch.randn(3, 4))
    assert out["y"].dtype is torch.float32 and out["n"] == 3
    assert out["rest"][0].dtype is out["rest"][1][0].dtype is out["rest"][1][1].a.dtype is torch.float32
    assert isinstance(out["rest"][1][1], Pair) and out["rest"][1][1].b.dtype is torch.int64


def test_o1_output_cast_trains_and_is_removed_by_deinitialize():
    m, opt = _model_and_opt()
    m, opt = amp_patch.initialize(m, opt, opt_level="O1", cast_model_outputs=torch.float32, loss_scale=128.0,
                                  verbosity=0)
    before = m.weight.detach().clone()
    with amp_patch.scale_loss(m(torch.randn(3, 4)).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(before, m.weight)
    amp_patch.deinitialize()
    assert not m._forward_hooks
    with amp_patch.autocast(dtype=torch.float16):
        assert m(torch.randn(3, 4)).dtype is torch.float16  # no output cast left behind


class Echo(torch.nn.Module):
    """Returns its input next to its output: which dtype the model saw, and how the output cast treats it."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 2)

    def forward(self, x, d):
        return self.l(x), d, d.dtype


@pytest.mark.parametrize("out_dtype, expected", [(None, torch.float32), (torch.float16, torch.float16)])
def test_apex_alias_o2_casts_float64_inputs_and_outputs_as_apex(out_dtype, expected):
    m = Echo()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = amp.initialize(m, opt, opt_level="O2", cast_model_outputs=out_dtype, verbosity=0)
    _, d, seen = m(torch.randn(3, 4), torch.randn(2, dtype=torch.float64))
    assert seen is torch.float16  # Apex's to_type: every floating input to the half type
    assert d.dtype is expected  # and every floating output to cast_model_outputs (default float32)


def test_apex_alias_o1_casts_float64_outputs_to_cast_model_outputs():
    m = Echo()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = amp.initialize(m, opt, opt_level="O1", cast_model_outputs=torch.float16, verbosity=0)
    out, d, seen = m(torch.randn(3, 4), torch.randn(2, dtype=torch.float64))
    assert seen is torch.float64  # O1: no input cast
    assert out.dtype is d.dtype is torch.float16


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_own_api_leaves_float64_model_inputs_and_outputs_alone(opt_level):
    m = Echo()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = amp_patch.initialize(m, opt, opt_level=opt_level, cast_model_outputs=torch.float16, verbosity=0)
    out, d, seen = m(torch.randn(3, 4), torch.randn(2, dtype=torch.float64))
    assert seen is torch.float64 and d.dtype is torch.float64
    assert out.dtype is torch.float16


@pytest.mark.parametrize("opt_level, outputs", [("O1", torch.float32), ("O2", None), ("O3", torch.float32)])
def test_own_api_leaves_float64_outputs_alone_at_an_fp32_output_dtype(opt_level, outputs):
    # (O2's default output dtype is fp32: a float64 output was cast to it, losing what needed float64)
    m = Echo()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    kwargs = {} if outputs is None else {"cast_model_outputs": outputs}
    m, opt = amp_patch.initialize(m, opt, opt_level=opt_level, verbosity=0, **kwargs)
    out, d, seen = m(torch.randn(3, 4), torch.randn(2, dtype=torch.float64))
    assert d.dtype is torch.float64 and out.dtype is torch.float32
