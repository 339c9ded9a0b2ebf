"""Forward hooks as amp_patch attaches them: the hook base classes and the helpers that keep a fused fast path.

* The hooks are plain objects (:class:`ForwardHook`): a model can be pickled and deep-copied during a session; a
  :class:`SessionHook` becomes an :class:`InertHook` in the copy. ``torch.jit.script`` is refused with the fix.
* ``TransformerEncoderLayer`` runs its fused kernel only when the layer has no forward hooks of its own. Hooks
  amp_patch must attach to such a layer (the model passed to ``initialize``, or every module under
  ``diagnose_overflow=True``) go on torch's global hook lists instead, filtered to that layer
  (:func:`forward_pre_hook`, :func:`forward_hook`). Global pre-hooks see positional arguments only; that layer's
  keyword arguments are masks it converts to the input's dtype itself and ``is_causal``.
* :func:`module_call_frame` and :func:`running` tell whether a module call whose hooks ran is still running (a
  ``KeyboardInterrupt`` skips torch's always-called hooks, so a call can end without its hook).
"""
import sys
import types

import torch
from torch.nn.modules import module as _module_mod

from ..errors import UsageError

FAST_PATH_TYPES = (torch.nn.TransformerEncoderLayer,)


class _NotScriptable(UsageError, AttributeError):
    """torch.jit.script asked an amp_patch hook for its ``__name__`` (also an AttributeError: hasattr says no)."""


_SCRIPT_HELP = ("torch.jit.script cannot compile amp_patch's forward hooks on this model, and TorchScript would not "
                "run amp_patch's casts anyway (it compiles torch calls to aten ops, past the O1 wrappers). Use "
                "torch.jit.trace(model, example_inputs) during the session: it records the casts; or script the "
                "model before amp_patch.initialize() or after amp_patch.deinitialize()")


class ForwardHook:
    """Base of amp_patch's forward hooks: plain objects (picklable), refused by torch.jit.script with the fix."""

    @property
    def __name__(self):
        raise _NotScriptable(_SCRIPT_HELP)


class SessionHook(ForwardHook):
    """A hook that belongs to the session: copies and pickles of the model get an inert hook instead."""

    def __deepcopy__(self, memo):
        return InertHook()

    def __reduce__(self):
        return InertHook, ()


def call_on_forward(fn):
    """A forward pre-hook or forward hook (a :class:`SessionHook`) that is ``fn`` itself: torch calls
    ``fn(module, *args_and_output)`` with no frame of the hook's own (its own class's ``__call__`` is ``fn``): the
    O1 engine's begin and end of every forward."""
    return type("CallOnForward", (SessionHook,), {"__call__": staticmethod(fn)})()


class InertHook(ForwardHook):
    """What a session hook becomes in a copied or unpickled model: does nothing."""

    _from_public_api = True  # (torch marks state_dict post-hooks registered through its public API)

    def __call__(self, *args, **kwargs):
        return None


def forward_pre_hook(module, hook, with_kwargs=False):
    """``module.register_forward_pre_hook`` unless a hook would cost ``module`` its fused fast path.

    ``hook`` has the signature of ``with_kwargs``; on a fast-path module it is called with the positional
    arguments only (and ``{}``) and its returned kwargs are ignored. Returns a removable handle.
    """
    if not isinstance(module, FAST_PATH_TYPES):
        return module.register_forward_pre_hook(hook, with_kwargs=with_kwargs)

    def global_hook(mod, args):
        if mod is not module:
            return None
        if not with_kwargs:
            return hook(mod, args)
        result = hook(mod, args, {})
        return result[0] if result is not None else None

    return _module_mod.register_module_forward_pre_hook(global_hook)


def forward_hook(module, hook, always_call=False):
    """``module.register_forward_hook`` unless a hook would cost ``module`` its fused fast path."""
    return forward_hooks([(module, hook)], always_call)[0]


def forward_hooks(pairs, always_call=False):
    """Forward hooks for many ``(module, hook)`` pairs; returns the handles.

    Modules that are (or sit inside) a fast-path layer share one global hook that looks the module up, so the
    per-call cost does not grow with the number of such modules.
    """
    inside = _fast_path_members(module for module, _ in pairs)
    handles, dispatch = [], {}
    for module, hook in pairs:
        if id(module) in inside:
            dispatch[id(module)] = (module, hook)
        else:
            handles.append(module.register_forward_hook(hook, always_call=always_call))
    if dispatch:
        def global_hook(mod, args, out):
            found = dispatch.get(id(mod))
            return found[1](mod, args, out) if found is not None and found[0] is mod else None

        handles.append(_module_mod.register_module_forward_hook(global_hook, always_call=always_call))
    return handles


def _fast_path_members(modules):
    """ids of the given modules that are, or are inside, a fast-path layer (it checks all of its modules)."""
    inside = set()
    for module in modules:
        for layer in module.modules():
            if isinstance(layer, FAST_PATH_TYPES):
                inside.update(id(m) for m in layer.modules())
    return inside


def _inner_code():
    for const in _module_mod.Module._call_impl.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == "inner":
            return const
    return None


_INNER = _inner_code()  # the code of torch's module call body that runs a module's own hooks and its forward
MODULE_CALL_CODE = _INNER if _INNER is not None else object()  # (for an inline module_call_frame: never a code)


def module_call_frame(depth):
    """The frame that called the caller ``depth`` frames up (``sys._getframe(depth + 1)``) if it is torch's module
    call running that module's own hooks (one call of one module: the same frame runs its pre-hooks, its forward
    and its hooks), else None (a global hook's dispatch, an exception's always-called hooks, another torch)."""
    frame = sys._getframe(depth + 1)
    return frame if _INNER is not None and frame.f_code is _INNER else None


def running(frame):
    """Whether ``frame`` is on this thread's stack (the call it runs has not ended)."""
    caller = sys._getframe(1)
    while caller is not None:
        if caller is frame:
            return True
        caller = caller.f_back
    return False
