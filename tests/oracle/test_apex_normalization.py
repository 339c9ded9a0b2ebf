"""apex.normalization (amp_patch.legacy.apex.normalization) against torch.nn.LayerNorm and the RMS norm formula."""
import pytest
import torch

from amp_patch.errors import ConfigError
from amp_patch.legacy.apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm


def _rms_reference(x, weight, eps):
    """Apex's documented RMS norm: x / sqrt(mean(x^2 over the normalized dims) + eps) * weight, in fp32."""
    x = x.float()
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight.float()


def _randomise(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module


def test_layer_norm_matches_torch_layer_norm_and_shares_its_state_dict_keys():
    torch.manual_seed(0)
    ref = _randomise(torch.nn.LayerNorm((3, 4), eps=1e-6))
    ours = FusedLayerNorm((3, 4), eps=1e-6)
    assert set(ours.state_dict()) == {"weight", "bias"}
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 4, requires_grad=True)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    ours(x).sum().backward()
    assert ours.weight.grad is not None and x.grad is not None
    assert (ours.normalized_shape, ours.eps, ours.elementwise_affine) == ((3, 4), 1e-6, True)
    plain = FusedLayerNorm(4, elementwise_affine=False)
    assert list(plain.state_dict()) == [] and plain.weight is None


def test_rms_norm_matches_the_formula():
    torch.manual_seed(0)
    norm = _randomise(FusedRMSNorm(8, eps=1e-5))
    assert set(norm.state_dict()) == {"weight"}
    x = torch.randn(5, 8)
    torch.testing.assert_close(norm(x), _rms_reference(x, norm.weight, 1e-5), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(FusedRMSNorm(8, elementwise_affine=False)(x), _rms_reference(x, None, 1e-5),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls,ref", [(MixedFusedLayerNorm, "ln"), (MixedFusedRMSNorm, "rms")])
def test_mixed_variants_keep_fp32_params_and_return_the_input_dtype(cls, ref):
    torch.manual_seed(0)
    norm = _randomise(cls(8))
    x = torch.randn(4, 8).to(torch.bfloat16)
    out = norm(x)
    assert norm.weight.dtype == torch.float32 and out.dtype == torch.bfloat16
    if ref == "ln":
        expect = torch.nn.functional.layer_norm(x.float(), (8,), norm.weight, norm.bias, 1e-5)
    else:
        expect = _rms_reference(x, norm.weight, 1e-5)
    torch.testing.assert_close(out, expect.to(torch.bfloat16), rtol=0, atol=0)
    assert norm.to(torch.bfloat16)(x.float()).dtype == torch.float32  # (the plain variant gives bf16 here)
    with pytest.raises(ConfigError, match="elementwise_affine"):
        cls(8, elementwise_affine=False)


def test_plain_variants_follow_apex_dtype_rule():
    """Mismatched dtypes: computed in fp32; output is the weight's dtype if half, else the input's."""
    x = torch.randn(2, 8)
    half_weight = FusedLayerNorm(8).to(torch.bfloat16)
    assert half_weight(x).dtype == torch.bfloat16
    assert FusedLayerNorm(8)(x.to(torch.bfloat16)).dtype == torch.bfloat16
    assert FusedRMSNorm(8).to(torch.bfloat16)(x).dtype == torch.bfloat16
