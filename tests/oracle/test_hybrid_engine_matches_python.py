"""The hybrid O1 engine (native autocast casts the ops that match it, inside forwards) gives the same bits as the
Python engine (``cast_engine="python"``: every op cast by its wrapper), on small models that reach each of its
paths and on a sample of torch's OpInfo ops.

Jobs reach: matching ops left to native (linear, conv, matmul, losses), ops that keep their wrapper with native
off (the RNN entry points, the fused encoder layer, reflection padding through a C++ composite), a weight used
twice in one forward (the cast cache), a native ``torch.autocast(enabled=False)`` block and ``disable_casts()``
inside a forward, a checkpointed block recomputed in backward, ``custom_fwd``, the apex list and float16.
``AMP_PATCH_FULL_OPDB=1`` compares every op of ``op_db`` (slow: minutes) instead of the sample.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from engine_compare import compare_jobs, compare_ops, op_calls
from torch import nn
from torch.utils.checkpoint import checkpoint

import amp_patch


def _mlp():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 5))
    y = torch.randint(0, 5, (8,))
    return model, torch.randn(8, 16), lambda out: F.cross_entropy(out, y)


def _convnet():
    model = nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(4, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    return model, torch.randn(2, 3, 8, 8), lambda out: out.float().pow(2).mean()


class _Tied(nn.Module):
    """Embedding tied to the head, the head's weight used twice per forward (one cached cast)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.norm(self.embed(tokens))
        return self.head(h) + F.linear(h, self.head.weight)


def _tied():
    tokens = torch.randint(0, 20, (4, 6))
    return _Tied(), tokens, lambda out: F.cross_entropy(out.flatten(0, 1), tokens.flatten())


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.rnn = nn.LSTM(16, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.rnn(self.layer(x))[0][:, -1])


def _encoder():
    return _Encoder(), torch.randn(2, 5, 16), lambda out: out.float().sum()


class _Regions(nn.Module):
    """fp32 blocks inside the forward (native ``enabled=False``, amp_patch's ``disable_casts``), a checkpointed
    block, a ``custom_fwd`` function."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            h = self.b(h.float()) + h.float()
        with amp_patch.disable_casts():
            h = torch.mm(h.float(), self.b.weight.float())
        h = checkpoint(lambda t: self.c(t).relu(), h, use_reentrant=False)
        return _Scale.apply(h) + self.a(h)


class _Scale(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        return x * 2

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        return grad * 2


def _regions():
    return _Regions(), torch.randn(4, 8), lambda out: out.float().pow(2).sum()


class _Composites(nn.Module):
    """Entry points whose C++ composite reaches ops native autocast casts (einsum and inner: bmm/mm inside;
    F.bilinear, bound to the builtin at import), called on fp32 tensors inside the forward."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.bw = nn.Parameter(torch.randn(4, 8, 8) / 3)

    def forward(self, x):
        a = torch.einsum("ij,jk->ik", x, self.w)
        b = torch.inner(x, self.w)
        c = F.bilinear(x, x, self.bw)
        return a.sum(1) + b.sum(1) + c.sum(1)


def _composites():
    return _Composites(), torch.randn(4, 8), lambda out: out.float().pow(2).sum()


JOBS = [("mlp", _mlp), ("convnet_reflection_pad", _convnet), ("tied_weight_twice", _tied),
        ("encoder_layer_lstm", _encoder), ("fp32_regions_checkpoint_custom_fwd", _regions),
        ("einsum_inner_bilinear", _composites)]


@pytest.mark.parametrize("half_dtype", [torch.bfloat16, torch.float16])
def test_training_steps_are_bitwise_equal_to_the_python_engine(half_dtype):
    assert compare_jobs(JOBS, half_dtype=half_dtype) == []


def test_training_steps_under_the_apex_list_are_bitwise_equal_to_the_python_engine():
    assert compare_jobs(JOBS, op_lists="apex") == []


def test_the_comparison_sees_a_difference():
    """The comparer is not blind: a job whose program differs between runs is reported."""
    runs = []

    def drifting():
        runs.append(1)
        model, batch, loss_fn = _mlp()
        return model, batch * len(runs), loss_fn

    assert compare_jobs([("drifting", drifting)], steps=1)


def _sample_ops():
    pytest.importorskip("expecttest")  # common_methods_invocations imports common_utils, which needs it
    from torch.testing._internal.common_methods_invocations import op_db

    if os.environ.get("AMP_PATCH_FULL_OPDB"):
        return op_db
    names = {"nn.functional.linear", "matmul", "mm", "addmm", "bmm", "nn.functional.conv2d", "nn.functional.pad",
             "nn.functional.cross_entropy", "nn.functional.mse_loss", "nn.functional.layer_norm", "cat", "stack",
             "index_copy", "prod", "cdist", "nn.functional.softmax", "sum", "add", "mul", "nn.functional.gelu",
             "nn.functional.scaled_dot_product_attention", "nn.functional.grid_sample", "linalg.vecdot",
             "nn.functional.binary_cross_entropy_with_logits", "addcmul", "nn.functional.embedding", "cov",
             "corrcoef", "tensordot", "nn.functional.bilinear", "linalg.matrix_power", "linalg.multi_dot",
             "linalg.pinv", "__rmatmul__"}
    return [op for op in op_db if op.name in names]


@pytest.mark.parametrize("op_lists", [None, "apex"])
def test_opinfo_samples_are_bitwise_equal_to_the_python_engine(op_lists):
    assert compare_ops(op_calls(_sample_ops()), op_lists=op_lists) == []
