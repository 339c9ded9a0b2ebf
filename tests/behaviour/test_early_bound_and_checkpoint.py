"""Code paths beyond torch/F/Tensor attributes: early-bound functions, checkpointing, custom Functions, inductor."""
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from tests_support import SmallNet
from torch.utils.checkpoint import checkpoint

import amp_patch


class GELUActivation(torch.nn.Module):
    """HF transformers style: the function is captured at construction."""

    def __init__(self):
        super().__init__()
        self.act = F.gelu

    def forward(self, x):
        return self.act(x)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.act = GELUActivation()

    def forward(self, x):
        return self.act(self.fc(x))


def test_early_bound_attribute_runs_through_the_wrapper_and_is_restored():
    block = Block()
    original = block.act.act
    assert original is F.gelu
    block = amp_patch.initialize(block, opt_level="O1", op_lists="apex", verbosity=0)  # gelu: Apex's float list
    assert block.act.act is not original and block.act.act is F.gelu  # the patched F.gelu wrapper
    out = block(torch.randn(2, 4))
    assert out.dtype is torch.float32  # gelu is in Apex's float list; the linear before it ran in half
    assert block.fc(torch.randn(2, 4)).dtype is torch.float16
    amp_patch.deinitialize()
    assert vars(block.act)["act"] is original


def test_import_time_binding_is_reported(caplog):
    user = types.ModuleType("user_model_mod")
    exec("from torch.nn.functional import gelu\nimport torch\n"
         "class Net(torch.nn.Module):\n    def forward(self, x):\n        return gelu(x)\n", vars(user))
    sys.modules["user_model_mod"] = user
    try:
        with caplog.at_level(logging.WARNING, logger="amp_patch"):
            amp_patch.initialize(user.Net(), opt_level="O1", op_lists="apex", verbosity=0)  # gelu: in Apex's list
        assert "user_model_mod.gelu" in caplog.text and "F.gelu" in caplog.text
    finally:
        del sys.modules["user_model_mod"]


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_checkpoint_recomputes_under_the_same_policy(reentrant, half):
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    amp_patch.initialize(block, opt_level="O1", half_dtype=half, verbosity=0)
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for use_checkpoint in (False, True):
        block.zero_grad()
        x.grad = None
        out = checkpoint(block, x, use_reentrant=reentrant) if use_checkpoint else block(x)
        assert out.dtype is half
        out.float().sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in block.parameters()])
        amp_patch.clear_cache()
    for plain, ckpt in zip(*grads):
        assert plain.dtype is ckpt.dtype and torch.equal(plain, ckpt)


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.dtype = x.dtype
        return x * x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        assert grad.dtype is ctx.dtype
        return 3 * x * x * grad


@pytest.mark.parametrize("decorator,expected", [(amp_patch.half_function, torch.float16),
                                                (amp_patch.float_function, torch.float32)])
def test_custom_function_apply(decorator, expected):
    cube = decorator(Cube.apply)
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", verbosity=0)
    source = torch.randn(3, dtype=torch.float32 if expected is torch.float16 else torch.float16,
                         requires_grad=True)
    out = cube(source)
    assert out.dtype is expected
    out.float().sum().backward()  # Cube.backward asserts it runs in the dtype forward chose
    assert source.grad.dtype is source.dtype


def test_decorators_pass_through_without_a_session():
    cube = amp_patch.half_function(Cube.apply)
    assert cube(torch.randn(2)).dtype is torch.float32


def test_custom_op():
    @torch.library.custom_op("amp_patch_test::scale2", mutates_args=())
    def scale2(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    wrapped = amp_patch.half_function(torch.ops.amp_patch_test.scale2)
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", verbosity=0)
    assert wrapped(torch.randn(2)).dtype is torch.float16
    assert scale2(torch.randn(2)).dtype is torch.float32


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_inductor_matches_eager(level):
    """Default backend (inductor, C++ codegen on CPU): dtypes as eager, values within bf16 resolution."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = amp_patch.initialize(SmallNet(), opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(4, 8)
    eager = model(x)
    counters_before = dict(torch._dynamo.utils.counters["graph_break"])
    compiled = torch.compile(model)(x)
    assert [t.dtype for t in compiled] == [t.dtype for t in eager]
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    assert dict(torch._dynamo.utils.counters["graph_break"]) == counters_before
    torch._dynamo.reset()
