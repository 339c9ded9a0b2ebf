"""Helpers shared by tests (imported as a plain module: pytest puts tests/ on sys.path)."""
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_MISSING = object()


def leaks_of(snapshot):
    """Names whose value in a snapshotted namespace changed (new submodules excepted)."""
    leaks = []
    for ns, old in snapshot.values():
        now = dict(vars(ns))
        for key in set(old) | set(now):
            if now.get(key, _MISSING) is old.get(key, _MISSING) or key == "__slotnames__":
                continue  # (__slotnames__ is copyreg's pickling cache, filled by the first torch.save)
            if key not in old and isinstance(now[key], types.ModuleType):
                continue
            leaks.append(f"{getattr(ns, '__name__', ns)}.{key}")
    return sorted(leaks)


class CountCasts(TorchDispatchMode):
    """Counts aten._to_copy calls (every dtype cast), with the target dtypes seen."""

    def __init__(self):
        super().__init__()
        self.casts = 0
        self.dtypes = []
        self.ops = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            self.casts += 1
            self.dtypes.append(kwargs.get("dtype"))
        out = func(*args, **kwargs)
        self.ops.append((func, getattr(out, "dtype", None)))
        return out
