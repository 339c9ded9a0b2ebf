"""The rest of the Apex surface real scripts touch (master_params without initialize, Apex's
warning class, FusedLayerNorm's ``memory_efficient`` and autocast casting, its autograd functions)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from amp_patch import legacy
from amp_patch.legacy.apex.normalization import fused_layer_norm as fln


def test_master_params_works_without_initialize_as_apexs_loop_did():
    """NVIDIA's BERT clips amp.master_params(optimizer) on its fp32 path too (no initialize)."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert list(legacy.amp.master_params(opt)) == list(model.parameters())
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    model, opt = legacy.amp.initialize(model, opt, opt_level="O2", verbosity=0)
    try:
        masters = list(legacy.amp.master_params(opt))
        assert [m.dtype for m in masters] == [torch.float32] * 2 and masters[0] is not model.weight
        assert len(list(legacy.amp.master_params(other))) == 2  # an optimizer initialize was not given
        with pytest.raises(amp_patch.UsageError):
            amp_patch.master_params(other)  # (the core API still says so)
    finally:
        amp_patch.deinitialize()


def test_deprecated_feature_warning_is_apexs_future_warning():
    with legacy.install_apex_alias():
        import apex
        assert issubclass(apex.DeprecatedFeatureWarning, FutureWarning)
        with warnings.catch_warnings():
            warnings.simplefilter("error", apex.DeprecatedFeatureWarning)
            with pytest.raises(apex.DeprecatedFeatureWarning):
                warnings.warn("old", apex.DeprecatedFeatureWarning, stacklevel=2)


@pytest.mark.parametrize("cls", [fln.FusedLayerNorm, fln.MixedFusedLayerNorm, fln.FusedRMSNorm,
                                 fln.MixedFusedRMSNorm])
def test_fused_norms_accept_memory_efficient_and_cast_under_autocast_as_apex_cuda_did(cls):
    torch.manual_seed(0)
    norm = cls(8, memory_efficient=True)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        if getattr(norm, "bias", None) is not None:
            norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    bias = getattr(norm, "bias", None)
    args = [t.to(torch.bfloat16).float() if t is not None else None for t in (x, norm.weight, bias)]
    if "RMS" in cls.__name__:
        want = F.rms_norm(args[0], (8,), args[1], norm.eps)
    else:
        want = F.layer_norm(args[0], (8,), args[1], args[2], norm.eps)
    assert out.dtype is torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    assert norm(x).dtype is torch.float32  # outside autocast: as before


def test_apex_norm_functions_are_importable_with_apexs_signatures():
    with legacy.install_apex_alias():
        from apex.normalization.fused_layer_norm import (
            FusedLayerNormAffineFunction,
            FusedRMSNormAffineFunction,
            fused_layer_norm_affine,
            mixed_dtype_fused_rms_norm_affine,
        )
    x = torch.randn(2, 4, requires_grad=True)
    w, b = torch.rand(4) + 0.5, torch.randn(4)
    out = FusedLayerNormAffineFunction.apply(x, w, b, (4,), 1e-5, True)
    assert torch.equal(out, F.layer_norm(x, (4,), w, b, 1e-5))
    out.sum().backward()
    assert x.grad is not None
    assert torch.equal(FusedRMSNormAffineFunction.apply(x, w, (4,), 1e-5), F.rms_norm(x, (4,), w, 1e-5))
    assert torch.equal(fused_layer_norm_affine(x, w, b, (4,)), F.layer_norm(x, (4,), w, b, 1e-6))
    half = mixed_dtype_fused_rms_norm_affine(x.detach().half(), w, (4,))
    assert half.dtype is torch.float16


def _old_adam_reference(p, g, m, v, step, lr, betas, eps, wd, combined, eps_inside, bias_correction):
    """The pre-October-2019 kernel, written out in float64 for one param."""
    b1, b2 = betas
    g = g.double() / combined
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = (v + eps).sqrt() if eps_inside else v.sqrt() + eps
    size = lr * (1 - b2 ** step) ** 0.5 / (1 - b1 ** step) if bias_correction else lr
    return p.double() - size * (m / denom + wd * p.double()), m, v


@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
def test_pre_2019_fused_adam_step_with_grads_output_params_scale_and_grad_norms(eps_inside_sqrt):
    from amp_patch.legacy.apex.optimizers import FusedAdam

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    opt = FusedAdam([p], lr=0.1, betas=(0.8, 0.9), eps=1e-3, eps_inside_sqrt=eps_inside_sqrt, weight_decay=0.01,
                    max_grad_norm=1.0)
    half_copy = torch.zeros(5, dtype=torch.float16)
    ref_p, m, v = p.detach().double(), torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    for step in (1, 2):
        grad = (torch.randn(5) * 64.0).half()  # scaled by 8; norm / 8 > max_grad_norm: clipped
        norm = float(grad.float().norm())
        opt.step(grads=[grad], output_params=[half_copy], scale=8.0, grad_norms=[norm])
        combined = 8.0 * ((norm / 8.0 + 1e-6) / 1.0)
        ref_p, m, v = _old_adam_reference(ref_p, grad, m, v, step, 0.1, (0.8, 0.9), 1e-3, 0.01, combined,
                                          eps_inside_sqrt, True)
        torch.testing.assert_close(p.detach().double(), ref_p, rtol=1e-5, atol=1e-6)
        assert torch.equal(half_copy, p.detach().half())
    assert opt.state[p]["step"] == 2


def test_hf_06_style_fp16_optimizer_over_old_fused_adam_trains():
    """pytorch-pretrained-BERT 0.6 with --fp16: model.half(), FusedAdam(..., bias_correction=False,
    max_grad_norm=1.0) wrapped in apex.optimizers.FP16_Optimizer(dynamic_loss_scale=True), optimizer.backward(loss),
    per-step lr in param_groups, step, zero_grad."""
    with legacy.install_apex_alias():
        from apex.optimizers import FP16_Optimizer, FusedAdam
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).half()
    groups = [{"params": [p for n, p in model.named_parameters() if "bias" not in n], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if "bias" in n], "weight_decay": 0.0}]
    optimizer = FP16_Optimizer(FusedAdam(groups, lr=0.05, bias_correction=False, max_grad_norm=1.0),
                               dynamic_loss_scale=True)
    x, y = torch.randn(16, 4).half(), torch.randn(16, 1).half()
    losses, skipped = [], 0
    for step in range(30):  # (the dynamic scale starts at 2**16, as Apex's amp LossScaler("dynamic"): no overflow)
        loss = F.mse_loss(model(x).float(), y.float())
        optimizer.backward(loss)
        for group in optimizer.param_groups:
            group["lr"] = 0.05 * (1 - step / 30)
        optimizer.step()
        skipped += optimizer.overflow
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(p.dtype is torch.float16 for p in model.parameters())
    assert skipped == 0 and losses[-1] < losses[0] * 0.8, (skipped, losses)


def test_bert_resume_and_post_accumulation_internals():
    """NVIDIA BERT: optimizer._lazy_init_maybe_master_weights(), optimizer._amp_stash on resume and after an
    overflow, and _amp_state.loss_scalers[0]._overflow_buf / update_scale() for --allreduce_post_accumulation."""
    from amp_patch.legacy import amp_state

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not hasattr(optimizer, "_amp_stash")
    model, optimizer = legacy.amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic", verbosity=0)
    try:
        optimizer._lazy_init_maybe_master_weights()
        optimizer._amp_stash.lazy_init_called = True
        stash = optimizer._amp_stash
        assert stash.all_fp32_from_fp16_params == list(legacy.amp.master_params(optimizer))
        assert stash.all_fp16_params == list(model.parameters()) and stash.all_fp32_from_fp32_params == []
        with pytest.raises(AttributeError):
            # not initialized: the attribute read is what raises
            torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)._amp_stash  # noqa: B018

        scaler = amp_state.AMP_STATE.loss_scalers[0]
        scaler._loss_scale = 128.0
        with legacy.amp.scale_loss(model(torch.ones(2, 3)).float().sum(), optimizer) as scaled:
            scaled.backward()
        flag = torch.zeros(1, dtype=torch.int)
        scaler._overflow_buf = flag
        assert scaler.update_scale() is False and scaler.loss_scale() == 128.0  # no double counting
        flag.fill_(1)  # the script's own all-reduced grads overflowed
        assert scaler.update_scale() is True and scaler.loss_scale() == 64.0
        before = [p.detach().clone() for p in legacy.amp.master_params(optimizer)]
        optimizer.step()
        assert amp_patch.last_step_skipped(optimizer)
        assert all(torch.equal(a, b) for a, b in zip(before, legacy.amp.master_params(optimizer)))
    finally:
        amp_patch.deinitialize()
    assert not hasattr(optimizer, "_amp_stash") and not hasattr(torch.optim.Optimizer, "_amp_stash")


def test_amp_c_update_scale_hysteresis_as_apexs_l0_test():
    from amp_patch.legacy.amp_C import update_scale_hysteresis as update

    init, growth, backoff, interval, hyst = 2.0 ** 10, 2.0, 0.5, 5, 3
    scale = torch.tensor([init])
    growth_tracker, hyst_tracker = torch.tensor([0], dtype=torch.int32), torch.tensor([hyst], dtype=torch.int32)
    found = torch.tensor([1.0])

    def run(n):
        for _ in range(n):
            update(scale, growth_tracker, hyst_tracker, found, growth, backoff, interval, hyst)

    run(hyst - 1)
    assert scale.item() == init  # hysteresis: not yet
    found.zero_()
    run(interval - 1)
    assert scale.item() == init  # not yet a full growth interval (and the hysteresis tracker is reset)
    found.fill_(1)
    run(hyst + 7)
    assert scale.item() == init * backoff ** 8  # one backoff when the tracker hits 0, then one per inf
    found.zero_()
    before = scale.item()
    run(interval + 12)
    assert scale.item() == before * growth ** 3 and growth_tracker.item() == 2


def test_amp_c_multi_tensor_unscale_l2norm_leaves_the_tensors_alone():
    from amp_patch.legacy.amp_C import multi_tensor_unscale_l2norm

    a, b = torch.full((7,), 4.0, dtype=torch.float16), torch.full((5,), 4.0)
    flag = torch.zeros(1, dtype=torch.int)
    norm, per = multi_tensor_unscale_l2norm(2048 * 32, flag, [[a, b]], torch.tensor([0.25]), True)
    torch.testing.assert_close(norm, torch.full((12,), 1.0).norm().reshape(1))
    torch.testing.assert_close(per, torch.stack([torch.ones(7).norm(), torch.ones(5).norm()]))
    assert flag.item() == 0 and torch.equal(a, torch.full((7,), 4.0, dtype=torch.float16))
    a[0] = float("inf")
    multi_tensor_unscale_l2norm(2048 * 32, flag, [[a, b]], torch.tensor([0.25]), False)
    assert flag.item() == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_adam_master_weights_keeps_fp32_masters_of_half_params(dtype):
    """FusedAdam(master_weights=True) (Apex 2023+): the half param is the cast of an fp32 master that follows
    exactly what fp32 FusedAdam does with the same grads."""
    from amp_patch.legacy.apex.optimizers import FusedAdam

    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(6))
    half = torch.nn.Parameter(ref.detach().to(dtype))
    ref.data.copy_(half.detach().float())  # both start from the same (representable) values
    opt_ref, opt = FusedAdam([ref], lr=0.01), FusedAdam([half], lr=0.01, master_weights=True)
    for _ in range(3):
        grad = torch.randn(6).to(dtype)
        ref.grad, half.grad = grad.float(), grad
        opt_ref.step()
        opt.step()
        master = opt.state[half]["master_param"]
        assert master.dtype is torch.float32 and torch.equal(master, ref.detach())
        assert torch.equal(half.detach(), ref.detach().to(dtype))


def test_fused_mixed_precision_lamb_updates_bf16_params_through_fp32_masters():
    from amp_patch.legacy.apex.optimizers import FusedLAMB, FusedMixedPrecisionLamb

    torch.manual_seed(0)
    refs = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    halves = [torch.nn.Parameter(r.detach().to(torch.bfloat16)) for r in refs]
    for r, h in zip(refs, halves):
        r.data.copy_(h.detach().float())
    opt_ref = FusedLAMB(refs, lr=0.01, weight_decay=0.01)
    opt = FusedMixedPrecisionLamb(halves, lr=0.01, weight_decay=0.01, reduced_precision_dtype=torch.bfloat16)
    for _ in range(2):
        for r, h in zip(refs, halves):
            h.grad = torch.randn_like(r).to(torch.bfloat16)
            r.grad = h.grad.float()
        opt_ref.step()
        opt.step()
    for r, h in zip(refs, halves):
        torch.testing.assert_close(opt.state[h]["master_param"], r.detach(), rtol=1e-6, atol=1e-7)
        assert h.dtype is torch.bfloat16
    with pytest.raises(amp_patch.UsageError, match="unscale"):
        opt.step(grad_scaler=object())


def test_amp_c_update_scale_hysteresis_flushes_a_subnormal_backoff_to_zero():
    """Apex's kernel (built with --use_fast_math) gives 0 where the back-off falls below the smallest normal
    fp32; its L0 fuzz test expects exactly that."""
    from amp_patch.legacy.amp_C import update_scale_hysteresis as update

    tiny = torch.finfo(torch.float32).tiny
    scale = torch.tensor([tiny * 1.5])
    trackers = torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    update(scale, *trackers, torch.tensor([1.0]), 2.0, 0.5, 10, 1)
    assert scale.item() == 0.0
