"""The per-thread casting switch every wrapper of an engine reads."""
import threading

import torch


class DisabledThreads(dict):
    """Thread ident -> depth of ``disable_casts()`` regions open in that thread.

    Wrappers test ``if disabled and get_ident() in disabled``: while no region is
    open anywhere that is one truth test of an empty dict (cheaper than a
    ``threading.local`` attribute read on every call).
    """

    on_change = None  # called with the thread's ident after its depth changed (the hybrid engine's fast regions)
    linked = ()  # switches closed with this one

    def enter(self):
        ident = threading.get_ident()
        self[ident] = self.get(ident, 0) + 1
        if self.on_change is not None:
            self.on_change(ident)

    def exit(self):
        ident = threading.get_ident()
        depth = self[ident] - 1
        if depth:
            self[ident] = depth
        else:
            del self[ident]
        if self.on_change is not None:
            self.on_change(ident)

    def set_depth(self, ident, depth):
        """Set a thread's depth outright (a checkpoint recompute runs with its forward's)."""
        if depth:
            self[ident] = depth
        else:
            self.pop(ident, None)
        if self.on_change is not None:
            self.on_change(ident)

    def here(self):
        return threading.get_ident() in self

    def close(self):
        """The engine is gone (session ended, or this is a forked child): every wrapper of it that someone still
        holds (``f = torch.mm`` taken during the session, a library's patch on top of ours) passes through. The
        wrappers' test ``disabled and ident in disabled`` is then true for every thread; open regions' exits are
        no-ops."""
        self.clear()
        self[None] = 1
        self.on_change = None
        self.__class__ = _ClosedThreads
        for other in self.linked:
            other.close()


class _ClosedThreads(DisabledThreads):
    """A closed switch: casting off in every thread, for good (kept out of the live class: no Python-level
    ``__contains__`` on the hot path)."""

    def __contains__(self, ident):
        return True

    def enter(self):
        pass

    def exit(self):
        pass

    def set_depth(self, ident, depth):
        pass

    def close(self):
        pass


def live_while_tracing(disabled):
    """Whether casting is off in this thread, read from the live switch as a constant of dynamo's graph.

    A native ``torch.autocast(enabled=False)`` region inside compiled code is entered by dynamo itself, at trace
    time (``native_regions``): that changes ``disabled`` behind dynamo's back, so the wrappers' own test of it
    reads dynamo's stale copy; the half caster asks this instead while compiling (no guard, no graph break)."""

    @torch.compiler.assume_constant_result
    def off_while_tracing():
        return threading.get_ident() in disabled

    return off_while_tracing
