"""Apex's compiled extension modules, imported by name as public scripts import them (``import fused_adam_cuda``,
``importlib.import_module("fused_layer_norm_cuda")``, ``importlib.util.find_spec("xentropy_cuda")``), are served
under the apex alias on torch math and called as those scripts call them; each result is checked against torch's
own op (autograd for the backward kernels). The alias removes them again on uninstall."""
import importlib
import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from amp_patch import legacy
from amp_patch.legacy.mirror import TOP_LEVEL

NAMES = ["amp_C", "apex_C", "syncbn", "fused_adam_cuda", "fused_lamb_cuda", "fused_layer_norm_cuda", "xentropy_cuda",
         "scaled_softmax_cuda", "scaled_masked_softmax_cuda", "generic_scaled_masked_softmax_cuda",
         "scaled_upper_triang_masked_softmax_cuda"]


@pytest.fixture
def ext():
    """``ext(name)``: the module ``import name`` gives under the alias (uninstalled after the test)."""
    handle = legacy.install_apex_alias()
    try:
        yield importlib.import_module
    finally:
        handle.uninstall()
    assert not [n for n in NAMES if n in sys.modules]


def test_every_extension_name_is_served_and_removed_on_uninstall():
    assert set(NAMES) <= set(TOP_LEVEL)
    with legacy.install_apex_alias():
        assert all(importlib.util.find_spec(name) is not None for name in NAMES)  # (availability checks)
        for name in NAMES:
            module = importlib.import_module(name)
            assert module.__name__ == name and all(callable(getattr(module, n)) for n in module.__all__
                                                   if not n.startswith("__"))
    assert all(importlib.util.find_spec(name) is None for name in NAMES)


def _apex_adam(p, m, v, g, lr, b1, b2, eps, scale, step, mode, decay):
    """Apex's fused_adam_cuda kernel, written out in float64."""
    p, m, v, g = (t.double() for t in (p, m, v, g))
    g = g / scale
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    denom = (v + eps).sqrt() if mode == 0 else v.sqrt() + eps
    step_size = lr * (1 - b2 ** step) ** 0.5 / (1 - b1 ** step)
    return p - step_size * (m / denom + decay * p), m, v


@pytest.mark.parametrize("mode", [0, 1])
def test_fused_adam_cuda_adam_as_the_old_fused_adam_called_it(ext, mode):
    fused_adam_cuda = ext("fused_adam_cuda")
    torch.manual_seed(0)
    p = torch.randn(7)
    m, v, out_p = torch.zeros(7), torch.zeros(7), torch.empty(7, dtype=torch.float16)
    ref = (p.double(), m.double(), v.double())
    for step in (1, 2, 3):
        g = (torch.randn(7) * 128).half()  # half grads scaled by 128, fp32 master, half model copy
        fused_adam_cuda.adam(p, out_p, m, v, g, 1e-2, 0.9, 0.999, 1e-8, 128.0, step, mode, 1, 0.01)
        ref = _apex_adam(ref[0], ref[1], ref[2], g.float(), 1e-2, 0.9, 0.999, 1e-8, 128.0, step, mode, 0.01)
    torch.testing.assert_close(p.double(), ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v.double(), ref[2], rtol=1e-5, atol=1e-9)
    assert torch.equal(out_p, p.half())
    lists = [[q.clone() for q in (torch.randn(3), torch.randn(5))] for _ in range(4)]
    lists[1] = [torch.zeros_like(t) for t in lists[1]]
    lists[2] = [torch.zeros_like(t) for t in lists[2]]
    one = [[t.clone() for t in group] for group in lists]
    fused_adam_cuda.adam_mt(2048 * 32, torch.zeros(1, dtype=torch.int), lists, 1e-3, 0.9, 0.999, 1e-8, 1.0, 1,
                            mode, 1, 0.0)
    for p_, m_, v_, g_ in zip(*one):
        fused_adam_cuda.adam(p_, torch.empty(0), m_, v_, g_, 1e-3, 0.9, 0.999, 1e-8, 1.0, 1, mode, 1, 0.0)
    assert all(torch.equal(a, b) for x, y in zip(lists, one) for a, b in zip(x, y))


def test_fused_adam_cuda_refuses_the_dtypes_apex_s_kernel_refused(ext):
    fused_adam_cuda = ext("fused_adam_cuda")
    half = torch.zeros(3, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="expected parameter to be of float type"):
        fused_adam_cuda.adam(half.clone(), torch.empty(0), half.clone(), half.clone(), half.clone(), 1e-3, 0.9, 0.999,
                             1e-8, 1.0, 1, 1, 1, 0.0)
    p, copy = torch.ones(3), torch.zeros(3, dtype=torch.float16)
    fused_adam_cuda.adam(p, copy, torch.zeros(3), torch.zeros(3), torch.ones(3), 1e-3, 0.9, 0.999, 1e-8, 1.0, 1, 1, 1,
                         0.0)
    assert not copy.any()  # (fp32 grads: Apex's kernel wrote no half copy)


def test_fused_adam_cuda_undo_and_checks(ext):
    fused_adam_cuda = ext("fused_adam_cuda")
    torch.manual_seed(0)
    p, m, v, g = torch.randn(6), torch.rand(6), torch.rand(6), torch.randn(6)
    before = [t.clone() for t in (p, m, v)]
    args = (1e-2, 0.9, 0.999, 1e-8, 1.0, 3, 1, 1, 0.0)
    fused_adam_cuda.adam(p, torch.empty(0), m, v, g, *args)
    fused_adam_cuda.maybe_adam_undo(torch.zeros(1, dtype=torch.int), p, m, v, g, *args)  # flag clear: kept
    assert not torch.equal(p, before[0])
    fused_adam_cuda.maybe_adam_undo(torch.ones(1, dtype=torch.int), p, m, v, g, *args)
    for now, then in zip((p, m, v), before):
        torch.testing.assert_close(now, then, rtol=1e-5, atol=1e-6)
    flag = torch.zeros(1, dtype=torch.int)
    fused_adam_cuda.strided_check_finite(flag, torch.tensor([1.0, float("inf"), 2.0]), 1, 1)
    assert flag.item() == 1
    fused_adam_cuda.strided_check_finite(flag, torch.tensor([1.0, float("inf"), 2.0]), 2, 1)  # (inf not strided)
    assert flag.item() == 0
    out = torch.zeros(3, dtype=torch.float16)
    fused_adam_cuda.maybe_cast(torch.ones(1, dtype=torch.int), torch.ones(3), out)
    assert out.sum() == 0
    fused_adam_cuda.maybe_cast(torch.zeros(1, dtype=torch.int), torch.ones(3), out)
    assert out.sum() == 3


class _MegatronLayerNorm(torch.autograd.Function):
    """The shape of Megatron-style code: an autograd Function over the extension imported by name."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps, memory_efficient):
        module = importlib.import_module("fused_layer_norm_cuda")
        out, mean, invvar = module.forward_affine(x.contiguous(), shape, weight, bias, eps)
        ctx.save_for_backward(out if memory_efficient else x, weight, bias, mean, invvar)
        ctx.shape, ctx.eps, ctx.memory_efficient = shape, eps, memory_efficient
        return out

    @staticmethod
    def backward(ctx, dout):
        saved, weight, bias, mean, invvar = ctx.saved_tensors
        module = importlib.import_module("fused_layer_norm_cuda")
        dx, dw, db = module.backward_affine(dout.contiguous(), mean, invvar, saved, ctx.shape, weight, bias, ctx.eps,
                                            ctx.memory_efficient)
        return dx, dw, db, None, None, None


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_fused_layer_norm_cuda_matches_torch_layer_norm_and_its_autograd(ext, memory_efficient):
    ext("fused_layer_norm_cuda")
    torch.manual_seed(0)
    x = torch.randn(3, 4, 10, dtype=torch.float64, requires_grad=True)
    w = torch.randn(10, dtype=torch.float64, requires_grad=True)
    b = torch.randn(10, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(3, 4, 10, dtype=torch.float64)
    ours = _MegatronLayerNorm.apply(x, w, b, (10,), 1e-5, memory_efficient)
    grads = torch.autograd.grad(ours, (x, w, b), dout)
    theirs = F.layer_norm(x, (10,), w, b, 1e-5)
    expected = torch.autograd.grad(theirs, (x, w, b), dout)
    torch.testing.assert_close(ours, theirs)
    for a, e in zip(grads, expected):
        torch.testing.assert_close(a, e)


def test_fused_layer_norm_cuda_rms_and_half_dtypes(ext):
    module = ext("fused_layer_norm_cuda")
    torch.manual_seed(0)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    out, invvar = module.rms_forward_affine(x.detach(), (8,), w.detach(), 1e-6)
    theirs = F.rms_norm(x, (8,), w, 1e-6)
    torch.testing.assert_close(out, theirs)
    dout = torch.randn(6, 8, dtype=torch.float64)
    dx, dw = module.rms_backward_affine(dout, invvar, x.detach(), (8,), w.detach(), 1e-6, False)
    for a, e in zip((dx, dw), torch.autograd.grad(theirs, (x, w), dout)):
        torch.testing.assert_close(a, e)
    half = torch.randn(4, 8).half()
    out, mean, invvar = module.forward_affine(half, (8,), torch.ones(8).half(), torch.zeros(8).half(), 1e-5)
    assert (out.dtype, mean.dtype, invvar.dtype, mean.shape) == (torch.float16, torch.float32, torch.float32, (4,))
    torch.testing.assert_close(out.float(), F.layer_norm(half.float(), (8,)), atol=1e-3, rtol=1e-3)
    mixed = module.forward_affine_mixed_dtypes(half, (8,), torch.ones(8), torch.zeros(8), 1e-5)[0]
    assert mixed.dtype is torch.float32
    assert module.forward(half, (8,), 1e-5)[0].dtype is torch.float16


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_xentropy_cuda_matches_cross_entropy_with_label_smoothing(ext, smoothing):
    xentropy_cuda = ext("xentropy_cuda")
    torch.manual_seed(0)
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (5,))
    losses, lse = xentropy_cuda.forward(logits.detach(), labels, smoothing, False)
    theirs = F.cross_entropy(logits, labels, reduction="none", label_smoothing=smoothing)
    torch.testing.assert_close(losses.double(), theirs)
    assert losses.dtype is torch.float32 and lse.dtype is torch.float64
    grad_loss = torch.randn(5, dtype=torch.float64)
    grad = xentropy_cuda.backward(grad_loss, logits.detach(), lse, labels, smoothing)
    torch.testing.assert_close(grad, torch.autograd.grad(theirs, logits, grad_loss)[0])
    half_losses, half_lse = xentropy_cuda.forward(logits.detach().half(), labels, smoothing, True)
    assert half_losses.dtype is torch.float32 and half_lse.dtype is torch.float32


def _masked_reference(x, scale, mask=None, causal=False):
    s = x * scale
    if mask is not None:
        s = s.masked_fill(mask, -10000.0)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1)


@pytest.mark.parametrize("name", ["scaled_softmax_cuda", "scaled_masked_softmax_cuda",
                                  "generic_scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"])
def test_megatron_softmax_kernels_match_torch_softmax_and_its_autograd(ext, name):
    module = ext(name)
    torch.manual_seed(0)
    causal = name.startswith("scaled_upper")
    shape = (6, 4, 4) if causal else (2, 3, 4, 4)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 1, 4, 4) < 0.3 if "masked" in name and not causal else None
    args = (x.detach(), mask, 0.5) if mask is not None else (x.detach(), 0.5)
    y = module.forward(*args)
    theirs = _masked_reference(x, 0.5, mask, causal)
    torch.testing.assert_close(y, theirs)
    g = torch.randn(*shape, dtype=torch.float64)
    torch.testing.assert_close(module.backward(g, y, 0.5), torch.autograd.grad(theirs, x, g)[0])
    assert module.forward(*((x.detach().half(),) + args[1:])).dtype is torch.float16
    if name == "scaled_masked_softmax_cuda":
        full = torch.ones(2, 1, 4, 4, dtype=torch.bool)
        assert module.forward(x.detach(), full, 1.0).abs().sum() == 0  # a row masked throughout: zeros
        assert module.get_batch_per_block(16, 16, 8, 4) == 16 and module.get_batch_per_block(512, 512, 8, 4) == 4


def test_fused_lamb_cuda_is_amp_c_s_lamb(ext):
    assert ext("fused_lamb_cuda").lamb is ext("amp_C").multi_tensor_lamb
