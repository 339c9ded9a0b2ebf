"""``amp_patch.autocast()``: patch-based O1 casting for a region or a function.

Inside an initialized O1 session casting is already on, so ``autocast()`` is a
no-op and ``autocast(enabled=False)`` turns casting off for the region. With no
session, the outermost region installs a temporary engine and removes every
patch on exit, so nothing leaks past the region (patches are process-wide: other
threads see them while the region is open).
"""
import contextlib
import functools
import threading
import warnings

import torch

from . import _state
from .engine import CastingEngine
from .errors import ConfigError
from .oplist import load_op_lists

_lock = threading.Lock()


@functools.lru_cache(maxsize=16)
def _shipped_table(name):
    return load_op_lists(name)


def _table_for(op_lists):
    if op_lists is None or isinstance(op_lists, str) and "/" not in op_lists and not op_lists.endswith(
            (".yaml", ".yml")):
        return _shipped_table(op_lists or "apex")
    return load_op_lists(op_lists)


class autocast(contextlib.ContextDecorator):  # noqa: N801 - mirrors torch.autocast
    """Context manager / decorator: O1 casting on (or, with ``enabled=False``, off) for the body."""

    def __init__(self, enabled=True, *, half_dtype=torch.float16, op_lists=None, allow_banned=False):
        if half_dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"half_dtype={half_dtype!r}; allowed: torch.float16, torch.bfloat16")
        self.enabled = bool(enabled)
        self.half_dtype = half_dtype
        self.op_lists = op_lists
        self.allow_banned = allow_banned
        self._stack = threading.local()

    def _frames(self):
        frames = getattr(self._stack, "frames", None)
        if frames is None:
            frames = self._stack.frames = []
        return frames

    def __enter__(self):
        stack = contextlib.ExitStack()
        engine = _state.active_engine()
        if engine is not None and not self.enabled:
            stack.enter_context(engine.casts_disabled())
        elif engine is None and self.enabled:
            stack.callback(self._open_region())
        self._frames().append(stack)
        return self

    def _open_region(self):
        from .registry import REGISTRY

        engine = CastingEngine(_table_for(self.op_lists), half_dtype=self.half_dtype,
                               allow_banned=self.allow_banned, registrations=REGISTRY.take())
        if engine.scopes is not None:  # (warnings shows it once per call site)
            warnings.warn("amp_patch.autocast(): the op list's scopes: section has no effect in an autocast() "
                          "region (it knows no model); pass the op list to amp_patch.initialize(model, ...) to "
                          "use scopes", UserWarning, stacklevel=3)
        with _lock:
            engine.install()
            _state.activate(None, engine)

        def close():
            with _lock:
                _state.deactivate()
                engine.uninstall()

        return close

    def __exit__(self, *exc):
        self._frames().pop().close()
        return False
