"""``apex._autocast_utils``: the helper Apex's fused modules (and code copied from them) call to follow an open
``torch.autocast`` region: ``_cast_if_autocast_enabled(*args)`` returns the args cast to the region's dtype (the
floating tensors; nested containers too), or unchanged outside one. Apex read the CUDA region only; here the
region of whichever device has one open (CUDA first), so the same code follows a CPU region too."""
import torch

__all__ = ["_cast_if_autocast_enabled"]


def _open_region():
    """The device type of the autocast region open in this thread (CUDA first), or None."""
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            return device_type
    return None


def _get_autocast_dtypes():
    """The half dtypes autocast can use here (Apex: bfloat16 where the CUDA device supports it)."""
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return [torch.half]
    return [torch.half, torch.bfloat16]


def _get_current_dtype(dtype=None):
    """The open region's dtype, else float32 (Apex's ``torch.float or dtype`` always gave float32)."""
    device_type = _open_region()
    return torch.float if device_type is None else torch.get_autocast_dtype(device_type)


def _cast_if_autocast_enabled(*args):
    device_type = _open_region()
    if device_type is None:
        return args
    return torch.amp.autocast_mode._cast(args, device_type, torch.get_autocast_dtype(device_type))
