"""``model.half()`` (``.bfloat16()``, ``.to(torch.bfloat16)``) after O2 ``initialize`` is refused.

Under O2 the model's fp32 params are the only weights (the half ones are per-call compute copies), so converting
them to half would silently train half weights (most updates then round away). While an O2 session with compute
copies is open, ``torch.nn.Module._apply`` (which ``half``, ``bfloat16``, ``to`` and ``type`` call on each module)
looks, for a module of such a model, at what the conversion makes of an fp32 tensor, and refuses a half dtype
before anything changed, naming the fix. Conversions that keep fp32 (``.to(device)``, ``.float()``) pass.
"""
import torch

from ..config.dtypes import HALF_DTYPES
from ..errors import UsageError
from ..weights import compute_copies


def install(patcher):
    patcher.install(torch.nn.Module, "_apply", _guarded)


def _guarded(original):
    def _apply(self, fn, *args, **kwargs):
        for copies in compute_copies.LIVE:
            if id(self) in copies.members:
                _check(copies, self, fn)
        return original(self, fn, *args, **kwargs)
    return _apply


def _check(copies, module, fn):
    try:
        dtype = fn(torch.zeros((), dtype=torch.float32)).dtype
    except Exception:  # noqa: BLE001 - a conversion that cannot take a probe converts nothing we can see
        return
    if dtype in HALF_DTYPES:
        raise UsageError(
            f"converting the {type(module).__name__} to {dtype} after amp_patch.initialize(opt_level='O2') "
            "(model.half(), .bfloat16(), .to(dtype)): under O2 its fp32 params are the only weights (each call "
            "runs on half copies made from them), so this would silently train half weights. Leave the model fp32 "
            "(O2 already runs it in the half dtype), convert it before initialize only for opt_level='O3', or "
            "call amp_patch.deinitialize() first")
