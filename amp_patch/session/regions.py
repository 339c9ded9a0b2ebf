"""``amp_patch.autocast()``: patch-based O1 casting for a region or a function.

It takes ``torch.autocast``'s arguments with their meaning (``device_type``, ``dtype``, ``enabled``,
``cache_enabled``; ``dtype`` defaults to the device's autocast dtype, as torch's does) and refuses what it
cannot honour. Inside an initialized O1 session casting is already on, so ``autocast()`` is a
no-op and ``autocast(enabled=False)`` turns casting off for the region. With no
session, or inside an O0/O2/O3 session (which casts no functions; it stays the
active session), the outermost region installs a temporary engine and removes every
patch on exit, so nothing leaks past the region (patches are process-wide: other
threads see them while the region is open).
"""
import contextlib
import functools
import threading
import warnings

import torch

from ..casting.engine import CastingEngine
from ..config.oplist import load_op_lists
from ..errors import ConfigError, UsageError
from ..patching.patcher import Patcher
from . import data_loading
from . import state as _state


@functools.lru_cache(maxsize=16)
def _shipped_table(name):
    return load_op_lists(name)


def _table_for(op_lists):
    if op_lists is None or isinstance(op_lists, str) and "/" not in op_lists and not op_lists.endswith(
            (".yaml", ".yml")):
        return _shipped_table(op_lists or "apex")
    return load_op_lists(op_lists)


class autocast(contextlib.ContextDecorator):  # noqa: N801 - mirrors torch.autocast
    """Context manager / decorator: O1 casting on (or, with ``enabled=False``, off) for the body.

    ``autocast(device_type=None, dtype=None, enabled=True, cache_enabled=None, *, half_dtype=None,
    op_lists=None, allow_banned=False)``: the positional order is torch.autocast's. ``dtype`` and
    ``half_dtype`` are the same thing (torch's name and amp_patch's); unset, it is the device's autocast dtype
    (``torch.get_autocast_dtype(device_type)``: bfloat16 on CPU, float16 on CUDA) or, without ``device_type``,
    float16 as in ``initialize``.
    """

    def __init__(self, device_type=None, dtype=None, enabled=True, cache_enabled=None, *, half_dtype=None,
                 op_lists=None, allow_banned=False):
        _check_device_type(device_type)
        if not isinstance(enabled, bool):
            raise ConfigError(f"enabled={enabled!r}; pass True or False (as torch.autocast requires)")
        if cache_enabled not in (None, True, False):
            raise ConfigError(f"cache_enabled={cache_enabled!r}; pass True, False or None (as torch.autocast takes)")
        # cache_enabled=False is torch's workaround for torch.jit.trace under autocast; amp_patch's wrappers never
        # use the cast cache while torch.jit traces (or dynamo compiles), so the flag is accepted and not needed
        self.explicit_dtype = _pick_dtype(dtype, half_dtype)
        self.half_dtype = self.explicit_dtype or (torch.get_autocast_dtype(device_type) if device_type
                                                  else torch.float16)
        if self.half_dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"dtype={self.half_dtype!r}; allowed: torch.float16, torch.bfloat16")
        self.device_type = device_type
        self.enabled = enabled
        self.op_lists = op_lists
        self.allow_banned = allow_banned
        self._stack = threading.local()

    def _frames(self):
        frames = getattr(self._stack, "frames", None)
        if frames is None:
            frames = self._stack.frames = []
        return frames

    def __enter__(self):
        engine = _state.active_engine()
        if engine is not None and self.enabled and self.explicit_dtype not in (None, engine.half_dtype):
            raise UsageError(f"amp_patch.autocast(dtype={self.explicit_dtype}) inside a session that casts to "
                             f"{engine.half_dtype}; a region cannot switch the half dtype: drop dtype, or "
                             "initialize with half_dtype=" + str(self.explicit_dtype))
        stack, frames = contextlib.ExitStack(), self._frames()
        try:  # each undo is on the stack before its step acts: an interrupt (Ctrl-C) anywhere leaves nothing open
            if engine is not None and not self.enabled:
                stack.enter_context(engine.casts_disabled())
            elif engine is not None:
                stack.callback(engine.exit_region)  # the cast cache serves the region; torch.autocast drops its
                engine.enter_region()  # cache as a region exits: so does this
            elif engine is None and self.enabled:
                self._open_region(stack)
            frames.append(stack)
        except BaseException:
            if frames and frames[-1] is stack:
                frames.pop()
            stack.close()
            raise
        return self

    def _open_region(self, stack):
        """This thread's own engine for the region (no session's is active); its undo goes on ``stack`` first."""
        from .user_functions import REGISTRY

        engine = CastingEngine(_table_for(self.op_lists), half_dtype=self.half_dtype,
                               allow_banned=self.allow_banned, registrations=REGISTRY.take(),
                               activation=_state.ACTIVATION)
        if engine.scopes is not None:  # (warnings shows it once per call site)
            warnings.warn("amp_patch.autocast(): the op list's scopes: section has no effect in an autocast() "
                          "region (it knows no model); pass the op list to amp_patch.initialize(model, ...) to "
                          "use scopes", UserWarning, stacklevel=3)
        loading = Patcher()

        def close():  # (an interrupt inside leaves it to deinitialize(), which runs it again)
            _state.closing(close)
            with _state.lock:
                if _state.active_engine() is engine:
                    _state.set_region_engine(None)
                loading.restore_all()
                engine.uninstall()
            _state.closed(close)

        stack.callback(close)
        with _state.lock:
            engine.install()
            data_loading.install(engine, loading)
            _state.set_region_engine(engine)  # an O0/O2/O3 session (no engine of its own) stays the active one
        stack.callback(engine.exit_region)
        engine.enter_region()

    def __exit__(self, *exc):
        self._frames().pop().close()
        return False


def _check_device_type(device_type):
    if device_type is None:
        return
    if not isinstance(device_type, str):
        raise ConfigError(f"autocast({device_type!r}): the first argument is device_type, as in torch.autocast "
                          "(e.g. 'cuda' or 'cpu'); pass enabled=... by keyword")
    try:
        kind = torch.device(device_type).type
    except RuntimeError:
        kind = None
    if kind != device_type:
        raise ConfigError(f"device_type={device_type!r}; pass a device type such as 'cuda' or 'cpu' (no index)")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device_type='cuda', but torch.cuda.is_available() is False on this machine; use 'cpu'")


def _pick_dtype(dtype, half_dtype):
    if dtype is not None and half_dtype is not None and dtype != half_dtype:
        raise ConfigError(f"dtype={dtype} and half_dtype={half_dtype} disagree; they are the same setting (torch's "
                          "name and amp_patch's): pass one")
    return dtype if dtype is not None else half_dtype
