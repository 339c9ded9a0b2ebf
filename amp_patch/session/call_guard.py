"""A forward cut off by Ctrl-C ends as one that raised: the session's always-called hooks run as it unwinds.

torch's module call runs the always-called forward hooks when the forward raises an ``Exception``; a
``KeyboardInterrupt`` (or any ``BaseException`` that is not an ``Exception``) skips them. amp_patch ends its
state of a call there (O1's casting region, with native autocast's switches and cast cache; O2's compute copies;
the nested models' open outer forwards), so before this guard a call cut off by Ctrl-C stayed open until something
found its frame gone, and code run in between saw it open: ops outside the model ran under native autocast,
a submodule called on its own computed with casts (O1) or half copies (O2) of weights changed since, and a region
closed inside a ``torch.inference_mode()`` block was switched on again when the block restored its thread state,
for good.

:func:`install` gives the class of each model passed to ``initialize`` a ``forward`` that runs the original in a
``try`` and, on such an exception, calls the model's always-called forward hooks that belong to the session
(:class:`SessionHook`), as torch calls them for an ``Exception`` (a hook's own failure is logged), then re-raises.
Instances of the class that are not a session's model (other models, copies) call straight through. dynamo traces
the ``try`` without a graph break (``torch.compile(fullgraph=True)`` of a session's model); an interrupt inside a
compiled graph is left to the frame checks, as torch runs no always-called hook there either.
Left to the frame checks (``running``): a call cut off inside a pre-hook or another hook, or started by a
submodule called on its own.
"""
import functools
import logging

from .._torch.hooks import SessionHook
from ..patching.patcher import Patcher

log = logging.getLogger(__name__)


def install(models):
    """Guard the forwards of ``models`` (see the module docstring); returns the undo callable."""
    patcher, guarded = Patcher(), set()
    for model in models:
        guarded.add(id(model))
        cls = type(model)
        if not any(p.target is cls for p in patcher.patches):
            patcher.install(cls, "forward", lambda original: _guard(original, guarded))
    return patcher.restore_all


def _guard(original, guarded):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if id(self) not in guarded:
            return original(self, *args, **kwargs)
        try:
            return original(self, *args, **kwargs)
        except Exception:
            raise
        except BaseException:  # noqa: B036 - Ctrl-C: end the call as torch ends one that raised, then re-raise
            end_cut_off_call(self, args, kwargs)
            raise
    return forward


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
