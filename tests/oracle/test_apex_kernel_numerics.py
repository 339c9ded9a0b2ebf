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


def _half_steps(opt, param, gen, steps=3):
    grads = []
    for _ in range(steps):
        param.grad = torch.rand(param.shape, generator=gen).half()
        grads.append(param.grad.clone())
        opt.step()
    return grads


def test_fused_adagrad_on_fp16_params_keeps_an_fp16_sum_computed_in_fp32():
    from amp_patch.legacy.apex.optimizers import FusedAdagrad
    gen = torch.Generator().manual_seed(1)
    start = torch.rand(64, generator=gen).half()
    param = torch.nn.Parameter(start.clone())
    grads = _half_steps(FusedAdagrad([param], lr=0.1, weight_decay=0.01), param, gen)
    # fused_adagrad.py: state['sum'] = torch.zeros_like(p); csrc/multi_tensor_adagrad.cu: fp32 registers, the
    # fresh fp32 sum feeds the update, p and sum each stored once in the param's dtype
    weight, total = start.clone(), torch.zeros(64, dtype=torch.float16)
    for g in grads:
        g32 = g.float() + 0.01 * weight.float()
        h32 = total.float() + g32 * g32
        weight, total = (weight.float() - 0.1 * (g32 / (h32.sqrt() + 1e-10))).half(), h32.half()
    assert torch.equal(param.detach(), weight)


def test_fused_adagrad_novograd_and_lamb_keep_half_params_state_in_the_params_dtype():
    from amp_patch.legacy.apex.optimizers import FusedAdagrad, FusedLAMB, FusedNovoGrad
    for cls, keys in ((FusedAdagrad, ("sum",)), (FusedNovoGrad, ("exp_avg",)), (FusedLAMB, ("exp_avg", "exp_avg_sq"))):
        for dtype in (torch.float16, torch.bfloat16):
            param = torch.nn.Parameter(torch.rand(8).to(dtype))
            opt = cls([param], lr=1e-2)
            param.grad = torch.rand(8).to(dtype)
            opt.step()
            assert [opt.state[param][k].dtype for k in keys] == [dtype] * len(keys), (cls.__name__, dtype)


def test_fused_novograd_on_fp16_params_keeps_an_fp16_moment_computed_in_fp32():
    from amp_patch.legacy.apex.optimizers import FusedNovoGrad
    gen = torch.Generator().manual_seed(2)
    start = torch.rand(64, generator=gen).half()
    param = torch.nn.Parameter(start.clone())
    opt = FusedNovoGrad([param], lr=0.1, weight_decay=0.01)
    grads = _half_steps(opt, param, gen)
    # fused_novograd.py: state['exp_avg'] = torch.zeros_like(p), the per-tensor norms fp32;
    # csrc/multi_tensor_novograd.cu: fp32 registers, the fresh fp32 moment feeds the update
    weight, m, v = start.clone(), torch.zeros(64, dtype=torch.float16), None
    for t, g in enumerate(grads, start=1):
        n = g.float().norm()
        v = n if v is None else v
        v = (0.999 * v * v + 0.001 * n * n).sqrt()
        m32 = 0.9 * m.float() + 0.1 * g.float()
        upd = (m32 / (1 - 0.9 ** t)) / (v / (1 - 0.999 ** t) ** 0.5 + 1e-8) + 0.01 * weight.float()
        weight, m = (weight.float() - 0.1 * upd).half(), m32.half()
    assert (opt.state[param]["exp_avg"].float() - m.float()).abs().max() <= 2 ** -10  # one fp16 ulp (fp32 order)
    assert (param.detach().float() - weight.float()).abs().max() <= 1e-3  # (norms: another summation order)


def test_fused_lamb_on_fp16_params_keeps_fp16_moments_and_rounds_the_update_to_fp16():
    from amp_patch.legacy.apex.optimizers import FusedLAMB
    gen = torch.Generator().manual_seed(3)
    start = torch.rand(64, generator=gen).half()
    param = torch.nn.Parameter(start.clone())
    opt = FusedLAMB([param], lr=0.1, weight_decay=0.01, max_grad_norm=1.0)
    grads = _half_steps(opt, param, gen)
    # fused_lamb.py: exp_avg/exp_avg_sq = torch.zeros_like(p); csrc/multi_tensor_lamb.cu: stage 1 in fp32
    # registers stores m, v and the update (into the grad) as fp16; stage 2 reads the fp16 update
    weight, m, v = start.clone(), torch.zeros(64, dtype=torch.float16), torch.zeros(64, dtype=torch.float16)
    for t, g in enumerate(grads, start=1):
        gnorm = float(g.float().norm())
        sg = g.float() / (gnorm if gnorm > 1.0 else 1.0)
        m32, v32 = 0.9 * m.float() + 0.1 * sg, 0.999 * v.float() + 0.001 * sg * sg
        upd = ((m32 / (1 - 0.9 ** t)) / ((v32 / (1 - 0.999 ** t)).sqrt() + 1e-6) + 0.01 * weight.float()).half()
        ratio = 0.1 * float(weight.float().norm()) / float(upd.float().norm())
        weight, m, v = (weight.float() - ratio * upd.float()).half(), m32.half(), v32.half()
    assert torch.equal(opt.state[param]["exp_avg"], m) and torch.equal(opt.state[param]["exp_avg_sq"], v)
    assert torch.equal(param.detach(), weight)
