"""Casting stays in the process that turned it on: a forked child (DataLoader workers with the fork start method,
persistent or not) inherits the patched torch functions, but every engine of the parent is closed in the child,
so its wrappers pass through there.

Measured (torch 2.13, CPU): native ``torch.autocast`` does reach fork workers (the forking thread's
thread-local state is copied into the child), and a persistent worker forked inside a region keeps casting after
the region exits. amp_patch does not follow that: a child can never learn that the parent's session ended, so
"off in every child" is the one state that is right both during and after the session, and it is what native
autocast gives with the spawn and forkserver start methods. Initialize amp_patch in the process that trains.
"""
import os
import weakref

_engines = weakref.WeakSet()  # installed engines of this process (the fork hook reads it; no other use)
_hooked = []


def watch(engine):
    """Close ``engine`` in any child forked while it lives (the hook is registered once, at the first install)."""
    _engines.add(engine)
    if not _hooked and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_close_in_child)
        _hooked.append(True)


def _close_in_child():
    for engine in list(_engines):
        if engine.fast is not None:  # the forking thread's native autocast state was copied into the child
            engine.fast.clear()
        engine.disabled.close()
    _engines.clear()
