"""Fused fast paths and SDPA under O1: like native autocast, the fused kernels run in half."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import amp_patch

MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
           "aten.linear.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
           "aten._scaled_dot_product_attention_math.default"}


class OpDtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen.append((str(func), getattr(out if not isinstance(out, tuple) else out[0], "dtype", None)))
        return out


def _encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_transformer_encoder_eval_no_grad(half):
    enc = _encoder()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        reference = enc(x)
        with torch.autocast("cpu", dtype=half):
            native = enc(x)  # (no dispatch mode here: a Python mode changes how native autocast dispatches)
    enc = amp_patch.initialize(enc, opt_level="O1", half_dtype=half, verbosity=0)
    with torch.no_grad(), OpDtypes() as ops:
        out = enc(x)
    assert out.dtype is native.dtype is half
    fused = [dtype for name, dtype in ops.seen if "_transformer_encoder_layer_fwd" in name]
    assert fused == [half, half], ops.seen  # both layers' fused kernels (their matmuls included) ran in half
    assert all(dtype is half for name, dtype in ops.seen if name in MATMULS)
    # the fused kernel runs wholly in half (native autocast decomposes it and keeps a few ops fp32), so compare
    # both with the fp32 reference at the half dtype's resolution (outputs are layer-normed, |y| <~ 3)
    atol = 2e-2 if half is torch.float16 else 1e-1
    torch.testing.assert_close(out.float(), reference, rtol=0, atol=atol)
    torch.testing.assert_close(native.float(), reference, rtol=0, atol=atol)


def test_multihead_attention_fast_path_runs_in_half():
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        reference, _ = mha(x, x, x)
        with torch.autocast("cpu", dtype=torch.float16):
            native, _ = mha(x, x, x)
    amp_patch.initialize(mha, opt_level="O1", verbosity=0)
    with torch.no_grad(), OpDtypes() as ops:
        out, _ = mha(x, x, x)
    assert [d for name, d in ops.seen if "_native_multi_head_attention" in name] == [torch.float16]
    assert out.dtype is native.dtype is torch.float16
    torch.testing.assert_close(out.float(), reference, rtol=0, atol=1e-2)  # fp16 resolution at |y| < 1


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_scaled_dot_product_attention_is_half(half):
    q = torch.randn(1, 2, 4, 8)
    with amp_patch.autocast(half_dtype=half):
        assert F.scaled_dot_product_attention(q, q, q).dtype is half
