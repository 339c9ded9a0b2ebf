"""The forward hooks that start and end O2's calls (:mod:`.compute_copies`), and the state of a call.

The model and every module owning cast params get a pre-hook (:class:`Install`) and an always-called hook
(:class:`Restore`). The outermost call in a thread starts at its module's pre-hook and ends at that module's
hook; inside it only that module counts its own calls (a recursive forward) and every other owner's hooks do
nothing, so hooks that third-party code moved or dropped (``fuse_modules``) cannot keep a call open, and a module
that starts a call without its hook gets one (:meth:`~.compute_copies.ComputeCopies.ensure_restore`). A call
found open at its module's next call whose frame no longer runs was cut off (a ``KeyboardInterrupt`` skips the
always-called hooks): its copies are dropped before the new call (:meth:`~.compute_copies.ComputeCopies.drop_stale`).
"""
import sys
import threading

from .._torch.compat import tracing
from .._torch.hooks import MODULE_CALL_CODE, SessionHook, running

_compiling = tracing


class Install(SessionHook):
    def __init__(self, owner):
        self.owner = owner

    def __call__(self, module, args):
        owner = self.owner
        if owner.live and not _compiling():
            call = owner.call
            # inside this thread's call: install's inner case, inlined (every owner of cast params has this hook,
            # so it runs for each of them on every forward)
            if call.depth:
                if module is not call.called:
                    if module is not owner.model or call.frame is None or running(call.frame):
                        return
                elif call.frame is None or running(call.frame):
                    call.depth += 1  # (a recursive call)
                    return
                owner.drop_stale()  # (the call in progress was cut off: its frame is gone)
            frame = sys._getframe(1)  # (module_call_frame(0): torch's call running this hook)
            owner.start_call(module, frame if frame.f_code is MODULE_CALL_CODE else None)  # (no call here now)
            if module is not owner.model or owner.restore_id not in module._forward_hooks_always_called \
                    or module._forward_hooks.get(owner.restore_id) is None:  # (the model's own: known, no frame)
                owner.ensure_restore(module)
            return
        owner.install(module)


class Restore(SessionHook):
    def __init__(self, owner):
        self.owner = owner

    def __call__(self, module, args, output):
        owner = self.owner
        if not _compiling():
            call = owner.call
            if call.depth and module is not call.called:  # uninstall's inner cases, inlined
                return None
            if call.depth > 1:
                if call.frame is None or sys._getframe(1) is not call.frame:
                    call.depth -= 1  # (a recursive call ends)
                    return None
                call.depth = 1  # the outermost call ends: recursive calls cut off inside it ended too
            if call.depth:  # (uninstall's case, its tests passed)
                call.depth = 0
                return owner.end_call(call, output)
        return owner.uninstall(output, module)


class GlobalHook(SessionHook):
    """Torch's global forward pre-hook or hook, dispatched to the fast-path layers it serves (a hook of their own
    would cost them their fused kernel)."""

    def __init__(self, layers, hook):
        self.layers, self.hook = layers, hook

    def __call__(self, module, *rest):
        if id(module) in self.layers and self.layers[id(module)] is module:
            return self.hook(module, *rest)
        return None


class TracedCall:
    """A call of the model: its depth, the module that started it, the copies it installed, the frame of torch's
    call that runs it (eager calls started by a hook; None: unknown). As such, the state of the call dynamo traces
    (a plain object: dynamo tracks changes to its attributes, not to a thread-local's)."""

    def __init__(self):
        self.depth = 0
        self.called = None
        self.frame = None
        self.swapped = []  # (module, its params dict, name, fp32 param, copy, the copy's version or None)
        self.edits = None  # thread_params.EDITS when every slot got its copy (None: a slot kept another dtype)


class ThreadCall(threading.local):
    """This thread's call of the model (the fields of :class:`TracedCall`, per thread)."""

    __init__ = TracedCall.__init__
