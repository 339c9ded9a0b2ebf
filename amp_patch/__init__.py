"""amp_patch: Apex-style automatic mixed precision for modern PyTorch.

Importing this package does nothing but define functions: no YAML is read, no
torch attribute is patched and no device is probed until ``initialize`` (or an
``autocast()`` region) asks for it.
"""
import torch

from .config.oplist import OpEntry, OpTable, load_op_lists, shipped_names
from .errors import (
    AmpPatchError,
    BannedOpError,
    CastError,
    ConfigError,
    NotInitializedError,
    OpListError,
    PatchError,
    TorchVersionError,
    UsageError,
)
from .parallel.fsdp2 import fully_shard
from .session.accessors import (
    clear_cache,
    history,
    last_overflow,
    last_step_skipped,
    load_state_dict,
    loss_scale,
    master_params,
    state_dict,
)
from .session.api import deinitialize, initialize
from .session.framework_hooks import attach_optimizers, next_step_skipped
from .session.regions import autocast
from .session.scale_loss import scale_loss
from .session.tracing import trace
from .session.user_functions import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)


def doctor(job, *, opt_level="O1", half_dtype=torch.float16, steps=40, op_lists=None, out=None):
    """Find the op behind persistent overflow / NaN under O1 and the op-list change that fixes it.

    See :func:`amp_patch.tools.doctor.doctor` (imported on first call: importing amp_patch stays cheap).
    """
    from .tools.doctor import doctor as run
    return run(job, opt_level=opt_level, half_dtype=half_dtype, steps=steps, op_lists=op_lists, out=out)


def speed_report(job, *, opt_level="O1", half_dtype=torch.bfloat16, steps=20, device="cpu", seed=0, threads=None):
    """Rank what holds ``job``'s training step back (data wait, host syncs, layer sizes, DataParallel, casts,
    optimizer, hardware), each with its measured figure and fix.

    See :func:`amp_patch.tools.speed.speed_report` (imported on first call: importing amp_patch stays cheap).
    """
    from .tools.speed import speed_report as run
    return run(job, opt_level=opt_level, half_dtype=half_dtype, steps=steps, device=device, seed=seed,
               threads=threads)


__version__ = "0.1.0"

__all__ = [
    "AmpPatchError", "BannedOpError", "CastError", "ConfigError", "NotInitializedError", "OpListError", "PatchError",
    "TorchVersionError", "UsageError",
    "OpEntry", "OpTable", "load_op_lists", "shipped_names", "autocast", "disable_casts", "float_function",
    "half_function", "promote_function", "register_float_function", "register_half_function",
    "register_promote_function", "initialize", "deinitialize", "clear_cache", "scale_loss", "master_params",
    "state_dict", "load_state_dict", "last_step_skipped", "loss_scale", "attach_optimizers", "next_step_skipped",
    "trace", "history", "last_overflow", "doctor", "speed_report", "fully_shard", "__version__",
]
