"""``apex.normalization.fused_layer_norm`` (re-exported by ``apex.normalization``): Apex's fused layer/RMS
norm modules on torch's ``F.layer_norm`` / ``F.rms_norm``.

Same constructor arguments, attributes (``normalized_shape``, ``eps``, ``elementwise_affine``) and
state_dict keys (``weight``, and ``bias`` for layer norm) as Apex. Dtypes follow Apex's kernels: when the
input and the weight differ in dtype the norm is computed in fp32 and the output takes the weight's dtype
if the weight is half, else the input's. The ``Mixed*`` variants keep fp32 params and always return the
input's dtype. Under ``torch.autocast`` the input and params are first cast to the autocast dtype (as Apex's CUDA
path did, on every device here): the output is in that dtype. ``memory_efficient=`` (Apex's recompute-in-backward
switch) is accepted: results are the same. Apex's autograd functions (``FusedLayerNormAffineFunction`` & co.) and
functional forms (``fused_layer_norm_affine`` & co.) are provided with Apex's argument order.
"""
import numbers

import torch
import torch.nn.functional as F

from ....errors import ConfigError

__all__ = ["FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm",
           "FusedLayerNormAffineFunction", "FusedLayerNormAffineMixedDtypesFunction", "FusedLayerNormFunction",
           "FusedRMSNormAffineFunction", "FusedRMSNormAffineMixedDtypesFunction", "FusedRMSNormFunction",
           "fused_layer_norm_affine", "fused_layer_norm", "mixed_dtype_fused_layer_norm_affine",
           "fused_rms_norm_affine", "fused_rms_norm", "mixed_dtype_fused_rms_norm_affine"]
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

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = bool(memory_efficient)
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
        weight, bias = self.weight, self.bias
        if torch.is_autocast_enabled(x.device.type):  # Apex's CUDA path: cast all to the autocast dtype first
            dtype = torch.get_autocast_dtype(x.device.type)
            cast = [t.to(dtype) if t is not None and t.is_floating_point() else t for t in (x, weight, bias)]
            with torch.autocast(x.device.type, enabled=False):
                return _mixed(self._call, *cast, out_dtype=dtype)
        if out_dtype is None:
            if weight is None or weight.dtype == x.dtype:
                return self._call(x, weight, bias)
            out_dtype = weight.dtype if weight.dtype in _HALF else x.dtype
        if weight is None and x.dtype == out_dtype:
            return self._call(x, None, None)
        return _mixed(self._call, x, weight, bias, out_dtype=out_dtype)


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
    kwargs.pop("memory_efficient", None)  # (accepted: the same results)
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


# -- Apex's autograd functions and functional forms (torch ops underneath: autograd derives the backward) ----------
def _layer_norm(x, weight, bias, normalized_shape, eps):
    return F.layer_norm(x, _shape(normalized_shape), weight, bias, eps)


def _rms_norm(x, weight, normalized_shape, eps):
    return F.rms_norm(x, _shape(normalized_shape), weight, eps)


class FusedLayerNormAffineFunction:
    """``FusedLayerNormAffineFunction.apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)``."""

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return _layer_norm(input, weight, bias, normalized_shape, eps)


class FusedLayerNormAffineMixedDtypesFunction(FusedLayerNormAffineFunction):
    """As Apex's: computed in fp32, output in the input's dtype."""

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return _mixed(lambda x, w, b: _layer_norm(x, w, b, normalized_shape, eps), input, weight, bias,
                      out_dtype=input.dtype)


class FusedLayerNormFunction:
    """``FusedLayerNormFunction.apply(input, normalized_shape, eps, memory_efficient=False)`` (no affine)."""

    @staticmethod
    def apply(input, normalized_shape, eps, memory_efficient=False):
        return _layer_norm(input, None, None, normalized_shape, eps)


class FusedRMSNormAffineFunction:
    """``FusedRMSNormAffineFunction.apply(input, weight, normalized_shape, eps, memory_efficient=False)``."""

    @staticmethod
    def apply(input, weight, normalized_shape, eps, memory_efficient=False):
        return _rms_norm(input, weight, normalized_shape, eps)


class FusedRMSNormAffineMixedDtypesFunction(FusedRMSNormAffineFunction):
    """As Apex's: computed in fp32, output in the input's dtype."""

    @staticmethod
    def apply(input, weight, normalized_shape, eps, memory_efficient=False):
        return _mixed(lambda x, w: _rms_norm(x, w, normalized_shape, eps), input, weight, out_dtype=input.dtype)


class FusedRMSNormFunction:
    """``FusedRMSNormFunction.apply(input, normalized_shape, eps, memory_efficient=False)`` (no affine)."""

    @staticmethod
    def apply(input, normalized_shape, eps, memory_efficient=False):
        return _rms_norm(input, None, normalized_shape, eps)


def _autocast(*tensors):
    """Apex's ``_cast_if_autocast_enabled``: under autocast, floating tensors go to the autocast dtype."""
    device = next(t.device.type for t in tensors if isinstance(t, torch.Tensor))
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)


def _no_autocast(fn, device_tensor, *args):
    with torch.autocast(device_tensor.device.type, enabled=False):
        return fn(*args)


def fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False):
    x, w, b = _autocast(input, weight, bias)
    return _no_autocast(FusedLayerNormAffineMixedDtypesFunction.apply, input, x, w, b, normalized_shape, eps)


def fused_layer_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    (x,) = _autocast(input)
    return _no_autocast(FusedLayerNormFunction.apply, input, x, normalized_shape, eps)


def mixed_dtype_fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False):
    x, w, b = _autocast(input, weight, bias)
    return _no_autocast(FusedLayerNormAffineMixedDtypesFunction.apply, input, x, w, b, normalized_shape, eps)


def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    x, w = _autocast(input, weight)
    return _no_autocast(FusedRMSNormAffineMixedDtypesFunction.apply, input, x, w, normalized_shape, eps)


def fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    (x,) = _autocast(input)
    return _no_autocast(FusedRMSNormFunction.apply, input, x, normalized_shape, eps)


def mixed_dtype_fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    x, w = _autocast(input, weight)
    return _no_autocast(FusedRMSNormAffineMixedDtypesFunction.apply, input, x, w, normalized_shape, eps)
