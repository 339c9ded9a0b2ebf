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


@pytest.mark.parametrize("diagnose", [False, True], ids=["plain", "diagnose_overflow"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_multihead_attention_fast_path_runs_in_half(level, diagnose):
    """MultiheadAttention as the model keeps its fused kernel: under O2/O3 the input cast hook casts the one
    tensor passed as query, key and value once (the fast path needs ``query is key is value``)."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        reference, _ = mha(x, x, x)
        with torch.autocast("cpu", dtype=torch.float16):
            native, _ = mha(x, x, x)
    opt = torch.optim.SGD(mha.parameters(), lr=0.1)
    mha, opt = amp_patch.initialize(mha, opt, opt_level=level, verbosity=0, diagnose_overflow=diagnose)
    with torch.no_grad(), OpDtypes() as ops:
        out, _ = mha(x, x, x)
    assert [d for name, d in ops.seen if "_native_multi_head_attention" in name] == [torch.float16], ops.seen
    assert native.dtype is torch.float16
    assert out.dtype is (torch.float16 if level == "O1" else torch.float32)  # O2/O3 cast the output back
    torch.testing.assert_close(out.float(), reference, rtol=0, atol=1e-2)  # fp16 resolution at |y| < 1


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_scaled_dot_product_attention_is_half(half):
    q = torch.randn(1, 2, 4, 8)
    with amp_patch.autocast(half_dtype=half):
        assert F.scaled_dot_product_attention(q, q, q).dtype is half


# -- the fast path survives amp_patch's own hooks ------------------------------------------------------------
def _fused_calls(model, x, half=torch.float16):
    with torch.no_grad(), OpDtypes() as ops:
        out = model(x)
    return [dtype for name, dtype in ops.seen if "_transformer_encoder_layer_fwd" in name], out


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_encoder_layer_as_the_model_keeps_its_fast_path(level):
    """torch's TransformerEncoderLayer refuses its fused kernel when it (or a submodule) has forward hooks; the
    hooks initialize attaches to the model it is given must not be on the layer itself."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        reference = layer(x)
    layer = amp_patch.initialize(layer, opt_level=level, verbosity=0)
    fused, out = _fused_calls(layer, x)
    assert fused == [torch.float16]
    assert out.dtype is (torch.float16 if level == "O1" else torch.float32)  # O2/O3 cast the output back
    torch.testing.assert_close(out.float(), reference, rtol=0, atol=2e-2)
    assert len(layer._forward_hooks) + len(layer._forward_pre_hooks) == 0


@pytest.mark.parametrize("as_model", ["layer", "encoder"])
def test_diagnose_overflow_keeps_the_fast_path_and_still_names_modules(as_model):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    model = layer if as_model == "layer" else torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", verbosity=0, diagnose_overflow=True)
    fused, _ = _fused_calls(model.eval(), torch.randn(2, 5, 16))
    assert fused == [torch.float16] * (1 if as_model == "layer" else 2)
    x = torch.randn(2, 5, 16)
    x[0, 0, 0] = float("inf")  # training mode: the decomposed path, whose modules the diagnoser must still see
    with amp_patch.scale_loss(model.train()(x).float().sum(), opt) as scaled:
        scaled.backward()
    origin = amp_patch.last_overflow()["first_bad_module"]
    prefix = "" if as_model == "layer" else "layers.0."
    assert origin["module"] == prefix + "self_attn", origin
