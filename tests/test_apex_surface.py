"""Issue 19 item 6: the rest of the Apex surface real scripts touch (master_params without initialize, Apex's
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
                warnings.warn("old", apex.DeprecatedFeatureWarning)


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
        from apex.normalization.fused_layer_norm import (FusedLayerNormAffineFunction, FusedRMSNormAffineFunction,
                                                         fused_layer_norm_affine, mixed_dtype_fused_rms_norm_affine)
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
