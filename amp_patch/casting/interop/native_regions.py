"""Native ``torch.autocast(enabled=False)`` regions turn amp_patch's casting off, as they turn native autocast off.

Code written for native autocast forces fp32 with ``with torch.autocast("cuda"/"cpu", enabled=False): ...``
(transformers' rotary embeddings; ``torch.cuda.amp.autocast(enabled=False)`` and ``torch.cpu.amp.autocast``
subclass it). torch's own state cannot tell such a region from no region under an amp_patch session (native
autocast is off in both), so while an engine is installed ``torch.amp.autocast_mode.autocast.__enter__`` and
``__exit__`` are wrapped (reversibly, through the engine's Patcher): a region for the engine's device type
(``engine.device_type``: ``"cuda"`` where CUDA is available, else ``"cpu"``) with ``enabled=False`` adds one
level to this thread's ``disable_casts`` depth, a nested ``enabled=True`` one takes it back for its body (the
innermost native region wins, as natively). Regions for another device type change nothing, as natively.
amp_patch's own regions (``disable_casts()``, ``autocast(enabled=False)``, the optimizer-step pause) are counted
apart: a native enabled region does not undo them.

``torch.amp.custom_fwd`` asks ``torch.is_autocast_enabled(device_type)`` whether to open its fp32 region (with
``cast_inputs``) and records the answer for ``custom_bwd``: asked from there, the patched ``is_autocast_enabled``
also answers True while amp_patch casts in this thread for that device type, so ``cast_inputs=torch.float32``
functions run in fp32 on fp32 inputs, as natively. ``custom_bwd`` then re-opens the forward's state as a region:
an enabled one of those turns amp_patch's casting on without turning native autocast on (it was amp_patch's
casting, not native's, that the forward saw; a forward under a genuine native region inside a session is
replayed the same way). Under ``torch.compile`` dynamo handles autocast regions itself and never calls
``__enter__``: the wrappers it traces cast as outside the region.
"""
import sys
import threading

import torch
from torch.amp import autocast_mode

from ..._torch.compat import tracing

_get_ident = threading.get_ident


def _inner_code(decorator):
    """The code object of the inner function ``custom_fwd``/``custom_bwd`` returns (found by decorating one)."""
    decorated = decorator(lambda *args: None, device_type="cpu")
    return getattr(decorated, "__code__", None)


_CUSTOM_FWD = _inner_code(autocast_mode.custom_fwd)
_CUSTOM_BWD = _inner_code(autocast_mode.custom_bwd)


def engine_device_type():
    return "cuda" if torch.cuda.is_available() else "cpu"


def install(engine, patcher):
    """Wrap ``autocast.__enter__``/``__exit__`` for ``engine`` (state: ``engine.native_regions``)."""
    regions, disabled, device_type = engine.native_regions, engine.disabled, engine.device_type
    native_exit = autocast_mode.autocast.__exit__  # (what undoes native's enter where ours is cut short)

    def make_enter(original):
        def __enter__(self):
            if getattr(self, "device", None) != device_type:
                return original(self)
            off = not self._enabled
            if not off and sys._getframe(1).f_code is _CUSTOM_BWD:
                self._enabled = False  # the forward's casting was amp_patch's: replay it, native stays off
            if engine.fast is not None:  # a fast region's native state is amp_patch's: the region saves the one below
                engine.fast.suspend()
            self.__dict__.pop("prev", None)  # (native's enter sets it: whether it ran, where an interrupt lands)
            try:
                result = original(self)
                _push(regions, disabled, self, off)
                return result
            except BaseException:  # (Ctrl-C: the caller's with runs no __exit__ for a region whose enter raised)
                _abandon(regions, disabled, self, native_exit)
                if engine.fast is not None:
                    engine.fast.sync()  # (what the region's exit does after its pop)
                raise

        return __enter__

    def make_exit(original):
        def __exit__(self, *exc):
            try:
                return original(self, *exc)
            finally:
                stack = regions.get(_get_ident())
                if stack and stack[-1][0] is self:
                    _pop(regions, disabled, stack)
                    if engine.fast is not None:
                        engine.fast.sync()

        return __exit__

    patcher.install(autocast_mode.autocast, "__enter__", make_enter)
    patcher.install(autocast_mode.autocast, "__exit__", make_exit)
    patcher.install(torch, "is_autocast_enabled", lambda original: _answer_custom_fwd(original, engine))
    if engine.fast is not None:
        patcher.install(torch._C, "_is_any_autocast_enabled", lambda original: _answer_any(original, engine))


def _answer_any(original, engine):
    """``torch._C._is_any_autocast_enabled`` (RNN input checks ask it) as the Python path answers it: in a fast
    region, whether native autocast was on before the region turned it on."""
    def _is_any_autocast_enabled():
        fast = engine.fast
        saved = fast.saved.get(_get_ident()) if fast is not None and fast.saved else None
        if saved is None:
            return original()
        return any(enabled for _, enabled, _ in saved)

    _is_any_autocast_enabled.__wrapped__ = original
    return _is_any_autocast_enabled


def _answer_custom_fwd(original, engine):
    """``torch.is_autocast_enabled`` that, asked by ``custom_fwd``'s inner function, also says whether amp_patch
    casts in this thread for ``engine.device_type`` (torch's answer everywhere else)."""
    disabled, device_type, compiling = engine.disabled, engine.device_type, tracing

    def is_autocast_enabled(*args, **kwargs):
        answer = original(*args, **kwargs)
        device = args[0] if args else kwargs.get("device_type", "cuda")
        fast = engine.fast
        if answer and fast is not None and fast.saved and _get_ident() in fast.saved and device in fast.device_types:
            answer = False  # native is on for a fast region (amp_patch's casting): answer as the Python path does
        if answer or disabled and _get_ident() in disabled:
            return answer  # the cheap tests first: only a False that amp_patch's casting could turn True walks
        # a frame, and only under custom_fwd
        return device == device_type and not compiling() and sys._getframe(1).f_code is _CUSTOM_FWD

    is_autocast_enabled.__wrapped__ = original
    return is_autocast_enabled


def _push(regions, disabled, region, off):
    """Enter a region: this thread's native-off state becomes ``off`` (one level of ``disabled`` while off). The
    entry records the thread's ``disabled`` depth before (and is recorded first): :func:`_abandon` puts it back."""
    ident = _get_ident()
    stack = regions.setdefault(ident, [])
    was_off = stack[-1][1] if stack else False
    stack.append((region, off, disabled.get(ident, 0)))
    if off and not was_off:
        disabled.enter()
    elif was_off and not off:
        disabled.exit()


def _abandon(regions, disabled, region, native_exit):
    """A region's enter cut short (an interrupt): undo what it did, whichever line it reached; nothing else runs in
    the thread meanwhile, so the recorded ``disabled`` depth is the one to put back."""
    ident = _get_ident()
    stack = regions.get(ident)
    if stack and stack[-1][0] is region:
        before = stack.pop()[2]
        disabled.set_depth(ident, before)
    if stack is not None and not stack:
        del regions[ident]
    if "prev" in region.__dict__:  # native's enter ran: its exit gives back the state and the nesting count
        native_exit(region, None, None, None)


def _pop(regions, disabled, stack):
    _, off, _ = stack.pop()
    was_off = stack[-1][1] if stack else False
    if not stack:
        del regions[_get_ident()]
    if off and not was_off:
        disabled.exit()
    elif was_off and not off:
        disabled.enter()
