"""The mirror's fp16 arithmetic where Apex's own tests expect torch's instead (``apex_l0.KNOWN_FAILURES`` and
``PORTED_AWAY`` rest on these): FusedSGD follows Apex's kernel (fp32 registers, one rounding per store), and
FusedLayerNorm under fp16 autocast gives the input grad computed in fp32 and rounded once."""
import torch

from amp_patch.legacy.apex.normalization import FusedLayerNorm
from amp_patch.legacy.apex.optimizers import FusedSGD


def test_fused_sgd_on_fp16_params_updates_with_the_fp32_momentum_before_storing_it_as_fp16():
    gen = torch.Generator().manual_seed(0)
    start = torch.rand(4096, generator=gen).half()
    param = torch.nn.Parameter(start.clone())
    opt = FusedSGD([param], lr=0.25, momentum=0.125)
    weight, momentum = start.clone(), None
    for _ in range(5):
        grad = torch.rand(4096, generator=gen).half()
        param.grad = grad
        opt.step()
        # csrc/multi_tensor_sgd_kernel.cu: loads widened to fp32, momentum and weight updated in registers,
        # each stored once as fp16
        mom32 = grad.float() if momentum is None else momentum.float() * 0.125 + grad.float()
        weight, momentum = (weight.float() + (-0.25 * mom32)).half(), mom32.half()
        assert torch.equal(param.detach(), weight)
        assert torch.equal(opt.state[param]["momentum_buffer"], momentum)


def test_fused_layer_norm_under_fp16_autocast_rounds_the_fp32_input_grad_once():
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(16, 32, 16, generator=gen).requires_grad_()
    dy = torch.rand(16, 32, 16, generator=gen).half()
    with torch.autocast("cpu", dtype=torch.float16):
        out = FusedLayerNorm([32, 16])(x)
    assert out.dtype == torch.float16
    out.backward(dy)
    x64 = x.detach().half().double().requires_grad_()
    torch.nn.functional.layer_norm(x64, [32, 16]).backward(dy.double())
    off = (x.grad.double() != x64.grad.half().double()).sum().item()
    assert off <= x.numel() // 500, off  # 8 of 8192 here (double rounding); fp16 arithmetic: over 1700
