"""The package's dtype vocabulary: the half dtypes, their names, and the one parser every entry point uses.

``initialize(half_dtype=...)``, ``autocast(dtype=...)``, the doctor and every command's ``--half-dtype`` read a
half dtype through :func:`parse_half_dtype`, so a name accepted in one place is accepted everywhere.
"""
import torch

from ..errors import ConfigError

FP32 = torch.float32
HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))

# what Lightning (precision="16-mixed"), Accelerate (mixed_precision="fp16") and torch users type for a half dtype
HALF_DTYPE_NAMES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "16": torch.float16,
                    "16-mixed": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                    "bf16-mixed": torch.bfloat16}


def parse_half_dtype(value, name="half_dtype"):
    """``torch.float16`` or ``torch.bfloat16`` from a dtype or one of :data:`HALF_DTYPE_NAMES` (also with a
    ``torch.`` prefix, any case, or the int 16); a :class:`~amp_patch.errors.ConfigError` for anything else."""
    if value in HALF_DTYPES:
        return value
    key = str(value).strip().lower().removeprefix("torch.") if isinstance(value, (str, int)) else None
    if key in HALF_DTYPE_NAMES and not isinstance(value, bool):
        return HALF_DTYPE_NAMES[key]
    raise ConfigError(f"{name}={value!r}; allowed: torch.float16, torch.bfloat16 (or by name: 'float16', 'fp16', "
                      "'half', '16', '16-mixed'; 'bfloat16', 'bf16', 'bf16-mixed')")


def dtype_name(dtype):
    """The canonical name of a dtype, as commands print it: ``"bfloat16"`` for ``torch.bfloat16``."""
    return str(dtype).removeprefix("torch.")
