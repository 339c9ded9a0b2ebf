"""A forward cut off by Ctrl-C ends as one that raised: the session's always-called hooks run as it unwinds.

torch's module call runs the always-called forward hooks when the forward raises an ``Exception``; a
``KeyboardInterrupt`` (or any ``BaseException`` that is not an ``Exception``) skips them. amp_patch ends its
state of a call there (O1's casting region, with native autocast's switches and cast cache; O2's compute copies;
the nested models' open outer forwards), so before this guard a call cut off by Ctrl-C stayed open until something
found its frame gone, and code run in between saw it open: ops outside the model ran under native autocast,
a submodule called on its own computed with casts (O1) or half copies (O2) of weights changed since, and a region
closed inside a ``torch.inference_mode()`` block was switched on again when the block restored its thread state,
for good.

:meth:`CallGuard.install` gives the class of each model passed to ``initialize`` a ``forward`` that runs the
original in a ``try`` and, on such an exception, calls the model's always-called forward hooks that belong to the
session (:class:`SessionHook`), as torch calls them for an ``Exception`` (a hook's own failure is logged), then
re-raises.
Instances of the class that are not a session's model (other models, copies) call straight through. Only a class
that defines ``forward`` itself as a plain function is guarded (not an inherited ``forward``, which would patch a
class other models share; not a descriptor; not a scripted or traced module or an fx ``GraphModule``, whose
``forward`` torch manages): the others are left to the frame checks, as is an interrupt inside a hook. Each class
gets its own code object (dynamo's recompile limit counts per code object), and the guard holds no closure: an
in-place reload of the class's ``forward`` (IPython's autoreload) replaces it, and deinitialize then hands the
reloaded code to the original function it puts back. dynamo traces the ``try`` with no graph break; an interrupt
inside a compiled graph is left to the frame checks, as torch runs no always-called hook there either.
"""
import inspect
import logging
import types

import torch

from .._torch.hooks import SessionHook
from ..patching.patcher import Patcher

log = logging.getLogger(__name__)


class CallGuard:
    """The guards of one session: :meth:`undo` is known before :meth:`install` patches anything, so an
    interrupt between a patch and the end of ``install`` leaves nothing behind once the session's undo runs."""

    def __init__(self):
        self._patcher, self._codes = Patcher(), {}

    def install(self, models):
        """Guard the forwards of ``models`` (see the module docstring)."""
        guarded = set()
        for model in models:
            guarded.add(id(model))
            cls = type(model)
            if cls in self._codes or not _guardable(cls):
                continue
            replacement = self._patcher.install(cls, "forward",
                                                lambda original, cls=cls: _guard(cls, original, guarded))
            self._codes[cls] = replacement.__code__

    def undo(self):
        try:
            for patch in self._patcher.patches:
                _carry_reload(patch, self._codes.get(patch.target))
        finally:  # the patches go back even if handing a reload back failed
            self._patcher.restore_all()


def _guardable(cls):
    return (type(vars(cls).get("forward")) is types.FunctionType
            and not issubclass(cls, (torch.jit.ScriptModule, torch.fx.GraphModule)))


def _guarded_forward(self, *args, _original=None, _guarded=(), **kwargs):
    if id(self) not in _guarded:
        return _original(self, *args, **kwargs)
    try:
        return _original(self, *args, **kwargs)
    except Exception:
        raise
    except BaseException:  # noqa: B036 - Ctrl-C: end the call as torch ends one that raised, then re-raise
        end_cut_off_call(self, args, kwargs)
        raise


def _guard(cls, original, guarded):
    """The guard of ``cls`` (its own code object; ``original`` and ``guarded`` as keyword defaults, no closure)."""
    code = _guarded_forward.__code__.replace(co_name="forward", co_qualname=f"{cls.__qualname__}.forward")
    forward = types.FunctionType(code, _guarded_forward.__globals__, "forward")
    forward.__kwdefaults__ = {"_original": original, "_guarded": guarded}
    for name in ("__module__", "__doc__", "__qualname__", "__annotations__"):
        setattr(forward, name, getattr(original, name))
    forward.__dict__.update(original.__dict__)
    forward.__wrapped__ = original  # (inspect.signature shows the original's)
    forward.__signature__ = inspect.signature(original)  # (so does getfullargspec, which follows no __wrapped__)
    return forward


def _carry_reload(patch, code):
    """The guard's code was replaced in place (an autoreload of the class's forward): the original function put back
    gets the reloaded code, as the reload would have given it."""
    current = vars(patch.target).get(patch.name)
    if current is patch.replacement and code is not None and current.__code__ is not code:
        try:
            patch.raw.__code__ = current.__code__
            patch.raw.__defaults__, patch.raw.__kwdefaults__ = current.__defaults__, current.__kwdefaults__
        except ValueError:  # (another count of free variables: left as it was)
            log.warning("amp_patch: %s.forward was reloaded during the session and cannot be handed back; "
                        "reload it again", patch.target.__qualname__)


def end_cut_off_call(module, args, kwargs):
    """Run ``module``'s always-called forward hooks that belong to the session, with no output."""
    always, with_kwargs = module._forward_hooks_always_called, module._forward_hooks_with_kwargs
    for hook_id, hook in list(module._forward_hooks.items()):
        if hook_id not in always or not isinstance(hook, SessionHook):
            continue
        try:
            if hook_id in with_kwargs:
                hook(module, args, kwargs, None)
            else:
                hook(module, args, None)
        except Exception:  # as torch does for an always-called hook that fails after a raised forward
            log.warning("amp_patch: ending a call of %s cut off by an interrupt failed in %r",
                        type(module).__name__, hook, exc_info=True)
