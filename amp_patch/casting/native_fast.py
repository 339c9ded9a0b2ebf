"""The hybrid engine's fast regions: native autocast (C++) casts the ops that match native, per thread.

A fast region is open in a thread while a forward of a session's model runs there (the engine's
``begin_forward``/``end_forward``) and nothing amp_patch or the user did in that thread asks for the Python path:

* casting off (``disable_casts()``, the optimizer-step pause, a DataLoader fetch, a native
  ``torch.autocast(enabled=False)`` region, a checkpoint recompute of a forward that ran with casting off),
* a native ``torch.autocast`` region of the user's, enabled or not (native and the wrappers then cast as today),
* dynamo tracing (compiled code traces the Python wrappers, as before).

While it is open: ``torch.autocast``'s thread-local state is on for the engine's device types with the engine's
half dtype, the wrappers of the ops that match native (:mod:`.native_plan`) pass straight through (their switch,
``bypass``, holds this thread), and every other wrapper runs its Python casts with native autocast excluded for
the call (:func:`native_off`), so each op is cast by exactly one of the two. Suspending or closing restores the
native state the region found. The cast cache: native's caches the same weights the Python cache would (a leaf
that requires grad) and both are dropped as each forward starts and ends; see docs/architecture.md for the
cases that keep the Python path and why.
"""
import functools
import threading

import torch

from .._torch.compat import tracing
from .switch import DisabledThreads

_get_ident = threading.get_ident
_DisableAutocast = torch._C._DisableAutocast
_set_enabled, _set_dtype = torch.set_autocast_enabled, torch.set_autocast_dtype
_is_enabled, _get_dtype = torch._C.is_autocast_enabled, torch._C.get_autocast_dtype
_clear_native_cache = torch.clear_autocast_cache
_increment_nesting, _decrement_nesting = torch.autocast_increment_nesting, torch.autocast_decrement_nesting
_compiling = tracing


class FastRegions:
    """Per-thread fast-region state of one engine (see the module docstring)."""

    def __init__(self, engine, device_types):
        self.engine = engine
        self.device_types = tuple(device_types)
        self.half_dtype = engine.half_dtype
        self.depth = {}  # ident -> open session-model forwards that asked for a fast region
        self.saved = {}  # ident -> the native state found when the region turned native on
        self.nested = set()  # idents whose region holds one of native's nesting counts (recorded before it is
        # taken, forgotten after it is given back, never given back below 0: an interrupt anywhere leaves none held)
        self.bypass = DisabledThreads()  # the matching wrappers' switch: threads with casting off or a fast region
        self.bypass.update(engine.disabled)
        engine.disabled.on_change = self.sync
        engine.disabled.linked = (self.bypass,)  # a closed engine (session over, forked child) passes through

    # forwards of the session's models

    def open(self):
        """A forward starts: the outermost one is one native cache region (as the Python cache's), counted in
        native's nesting so that a user's ``torch.autocast`` region inside it does not drop the casts on exit."""
        if not _compiling():
            self.open_eager(_get_ident())

    def open_eager(self, ident):
        """:meth:`open` for thread ``ident`` (this one), its caller having checked that dynamo is not tracing."""
        depth = self.depth.get(ident, 0)
        self.depth[ident] = depth + 1
        if not depth:  # (_hold_nesting inline)
            if ident not in self.nested:
                self.nested.add(ident)
                _increment_nesting()
            _clear_native_cache()
            if ident in self.saved:  # (a state no forward holds: a close an interrupt cut short after restoring
                self._turn_off(ident)  # part of it; put back what it found, then turn native on as usual)
        if ident not in self.saved:
            engine = self.engine
            if ident in engine.disabled or engine.native_regions.get(ident) or engine.tracer is not None:
                self.sync(ident)
                return
            saved = self.saved[ident] = []  # (sync's usual case, _turn_on inline: every forward opens here)
            for device in self.device_types:
                saved.append((device, _is_enabled(device), _get_dtype(device)))
                _set_dtype(device, self.half_dtype)
                _set_enabled(device, True)
            self.bypass[ident] = 1

    def close(self):
        if not _compiling():
            self.close_eager(_get_ident())

    def close_eager(self, ident):
        depth = self.depth.get(ident, 0) - 1
        if depth > 0:
            self.depth[ident] = depth
            return
        if self.depth.pop(ident, None) is not None:  # (_end and sync's case of no forward left, in this frame:
            saved = self.saved.get(ident)            # every forward of a session model ends here)
            if saved is not None:  # (_turn_off inline)
                for device, enabled, dtype in saved:
                    _set_enabled(device, enabled)
                    _set_dtype(device, dtype)
                del self.saved[ident]
            if ident in self.engine.disabled:
                self.bypass[ident] = 1
            else:
                self.bypass.pop(ident, None)
            if ident in self.nested:  # (_release_nesting inline)
                left = _decrement_nesting()
                self.nested.discard(ident)
                if left <= 0:
                    if left < 0:
                        _increment_nesting()
                    _clear_native_cache()

    def forget_dead_thread(self, ident):
        """A dead thread's region under ``ident``, reused by this thread: its depth, saved state and switch go
        without restoring anything (native state is per thread: the dead thread's went with it)."""
        self.depth.pop(ident, None)
        self.saved.pop(ident, None)
        self.nested.discard(ident)
        if ident not in self.engine.disabled:
            self.bypass.pop(ident, None)

    def forget(self):
        """This thread's forwards are over (one that raised may have left its region open)."""
        ident = _get_ident()
        self.depth.pop(ident, None)
        self.sync(ident)  # (also where a close cut short had popped the depth but not yet restored native's state)
        self._release_nesting(ident)

    def _release_nesting(self, ident):
        """Give back the nesting count this thread's region holds, if any (see ``nested``)."""
        if ident in self.nested:
            left = _decrement_nesting()
            self.nested.discard(ident)
            if left <= 0:
                if left < 0:  # (an interrupt between the record and the count taken: none was held)
                    _increment_nesting()
                _clear_native_cache()

    # the state machine

    def sync(self, ident=None):
        """Bring this thread's native state and switches in line with what it wants: native on while a forward of
        the session's models is open in the thread, casting is on there, no native region of the user's is open
        and no tracer runs (every switch change of the thread comes here)."""
        ident = _get_ident() if ident is None else ident
        if ident != _get_ident():
            return  # (a closed switch) native state is thread-local: only its own thread can change it
        engine = self.engine
        want = (ident in self.depth and ident not in engine.disabled and not engine.native_regions.get(ident)
                and engine.tracer is None)
        if want and ident not in self.saved:
            self._turn_on(ident)
        elif not want and ident in self.saved:
            self._turn_off(ident)
        if ident in self.saved or ident in engine.disabled:
            self.bypass[ident] = 1
        else:
            self.bypass.pop(ident, None)

    def suspend(self):
        """Native off now, before a user's native region saves the state it will restore (native_regions)."""
        ident = _get_ident()
        if ident in self.saved:
            self._turn_off(ident)
            if ident not in self.engine.disabled:
                self.bypass.pop(ident, None)

    def _turn_on(self, ident):  # (inline in open_eager: keep the two alike)
        """Native on in this thread. The state found is recorded before it changes, and :meth:`_turn_off` forgets it
        only once restored: an interrupt (Ctrl-C) anywhere in between leaves what changed undoable."""
        saved = self.saved[ident] = []
        for device in self.device_types:  # (one loop, no comprehension frame: every forward turns native on)
            saved.append((device, _is_enabled(device), _get_dtype(device)))
            _set_dtype(device, self.half_dtype)
            _set_enabled(device, True)

    def _turn_off(self, ident):  # (inline in close_eager: keep the two alike)
        for device, enabled, dtype in self.saved[ident]:
            _set_enabled(device, enabled)
            _set_dtype(device, dtype)
        del self.saved[ident]

    def clear(self):
        self.depth.pop(_get_ident(), None)
        self._release_nesting(_get_ident())
        self.nested.clear()
        self.depth.clear()
        if _get_ident() in self.saved:
            self._turn_off(_get_ident())
        self.saved.clear()
        self.bypass.clear()

    def here(self):
        return _get_ident() in self.saved


def _excluding_native(call, bypass, ident, args, kwargs):
    """``call`` with native autocast excluded and this thread out of ``bypass``: the wrappers of matching ops that
    ``call`` reaches (a Python op calling ``torch.matmul``) cast in Python, as the Python engine does."""
    was = bypass.pop(ident, None)
    try:
        with _DisableAutocast():
            return call(*args, **kwargs)
    finally:
        if was is not None:
            bypass[ident] = was


def native_off(inner, fast):
    """``inner`` (a Python wrapper) run with native autocast excluded while a fast region is open in the thread."""
    saved, bypass, get_ident = fast.saved, fast.bypass, _get_ident

    def wrapper(*args, **kwargs):
        if saved and get_ident() in saved:
            return _excluding_native(inner, bypass, get_ident(), args, kwargs)
        return inner(*args, **kwargs)

    functools.update_wrapper(wrapper, inner)
    wrapper.__wrapped__ = getattr(inner, "__wrapped__", inner)
    return wrapper


def off_only(original, entry, fast):
    """The wrapper of an op native would cast where the Python engine does not: native off in a fast region."""
    saved, bypass, get_ident = fast.saved, fast.bypass, _get_ident

    def wrapper(*args, **kwargs):
        if saved and get_ident() in saved:
            return _excluding_native(original, bypass, get_ident(), args, kwargs)
        return original(*args, **kwargs)

    functools.update_wrapper(wrapper, original)
    wrapper.__wrapped__ = original
    wrapper._amp_patch_entry = entry
    return wrapper
