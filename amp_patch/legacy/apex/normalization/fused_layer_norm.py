"""``apex.normalization.fused_layer_norm`` (re-exported by ``apex.normalization``): Apex's fused layer/RMS
norm modules on torch's ``F.layer_norm`` / ``F.rms_norm``.

Same constructor arguments, attributes (``normalized_shape``, ``eps``, ``elementwise_affine``) and
state_dict keys (``weight``, and ``bias`` for layer norm) as Apex. Dtypes follow Apex's kernels: when the
input and the weight differ in dtype the norm is computed in fp32 and the output takes the weight's dtype
if the weight is half, else the input's. The ``Mixed*`` variants keep fp32 params and always return the
input's dtype.
"""
import numbers

import torch
import torch.nn.functional as F

from ....errors import ConfigError

__all__ = ["FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm"]
_HALF = (torch.float16, torch.bfloat16)


def _shape(normalized_shape):
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(n) for n in normalized_shape)


def _mixed(fn, x, weight, *rest, out_dtype):
    """Run ``fn`` in fp32 on fp32 copies and return ``out_dtype``."""
    fp32 = [t.float() if t is not None else None for t in (weight,) + rest]
    return fn(x.float(), *fp32).to(out_dtype)


class _Norm(torch.nn.Module):
    _has_bias = True

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(*self.normalized_shape))
            if self._has_bias:
                self.bias = torch.nn.Parameter(torch.empty(*self.normalized_shape))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        if self.elementwise_affine:
            torch.nn.init.ones_(self.weight)
            if self.bias is not None:
                torch.nn.init.zeros_(self.bias)

    def extra_repr(self):
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(**self.__dict__)

    def _apply_norm(self, x, out_dtype=None):
        weight = self.weight
        if out_dtype is None:
            if weight is None or weight.dtype == x.dtype:
                return self._call(x, weight, self.bias)
            out_dtype = weight.dtype if weight.dtype in _HALF else x.dtype
        if weight is None and x.dtype == out_dtype:
            return self._call(x, None, None)
        return _mixed(self._call, x, weight, self.bias, out_dtype=out_dtype)


class FusedLayerNorm(_Norm):
    """Apex's FusedLayerNorm: ``FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)``."""

    def _call(self, x, weight, bias):
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)

    def forward(self, input):
        return self._apply_norm(input)


class FusedRMSNorm(_Norm):
    """Apex's FusedRMSNorm: ``x / sqrt(mean(x**2) + eps) * weight`` over the last dims (no bias)."""

    _has_bias = False

    def _call(self, x, weight, bias):
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)

    def forward(self, input):
        return self._apply_norm(input)


def _check_affine(name, kwargs):
    affine = kwargs.pop("elementwise_affine", True)
    if not affine:
        raise ConfigError(f"{name}(elementwise_affine={affine!r}): the mixed-dtype norm exists for its fp32 "
                          f"weight; use FusedLayerNorm/FusedRMSNorm (or torch.nn) without affine params")
    if kwargs:
        raise TypeError(f"{name}() got unexpected keyword arguments {sorted(kwargs)}")


class MixedFusedLayerNorm(FusedLayerNorm):
    """Apex's MixedFusedLayerNorm: fp32 params, computed in fp32, output in the input's dtype."""

    def __init__(self, normalized_shape, eps=1e-5, **kwargs):
        _check_affine("MixedFusedLayerNorm", kwargs)
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True)

    def forward(self, input):
        return self._apply_norm(input, out_dtype=input.dtype)


class MixedFusedRMSNorm(FusedRMSNorm):
    """Apex's MixedFusedRMSNorm: fp32 weight, computed in fp32, output in the input's dtype."""

    def __init__(self, normalized_shape, eps=1e-5, **kwargs):
        _check_affine("MixedFusedRMSNorm", kwargs)
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True)

    def forward(self, input):
        return self._apply_norm(input, out_dtype=input.dtype)
