"""The hook dicts of O2's inner owners read empty inside a call that another module started.

Every module owning cast params carries O2's :class:`~.call_hooks.Install` / :class:`~.call_hooks.Restore` pair
for the call it may start itself (a submodule called on its own, a checkpointed layer). Inside a call that
another module started (the usual case: the model's forward calling its layers) the pair does nothing, yet a
module with any forward hook takes torch's slow call path (about 6 us a call in a training step, per layer).
So an owner whose hook dicts held nothing of the user's gets a :class:`QuietHooks` for each: a ``dict`` that
reads false (``bool``) exactly while its thread's call in progress was started by another module and it holds
only amp_patch's pair; torch's ``_call_impl`` then takes its fast path, as if the module had no hooks. It reads
true otherwise (no call in progress, the module's own call, a hook of the user's added since, dynamo tracing, the
session over), and torch's slow path runs the hooks as before. Iterating, indexing and handles are the ``dict``'s.
"""
from collections import OrderedDict

import torch

_compiling = torch.compiler.is_compiling
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")


class QuietHooks(OrderedDict):
    """``module._forward_pre_hooks`` / ``_forward_hooks`` of an O2 inner owner (see the module docstring)."""

    def __init__(self, owner, module):
        super().__init__()
        self.owner, self.module, self.own = owner, module, set()

    def __bool__(self):
        if not len(self):
            return False
        owner = self.owner
        if owner.live and len(self) <= len(self.own):
            call = owner.call
            if call.depth and call.called is not self.module and not _compiling() and self.keys() <= self.own:
                return False
        return True

    def __reduce__(self):  # (pickles and copies of the model get torch's plain dicts)
        return OrderedDict, (list(self.items()),)

    def __deepcopy__(self, memo):
        import copy
        return OrderedDict((key, copy.deepcopy(hook, memo)) for key, hook in self.items())


def quieten(module, owner):
    """Give ``module`` quiet hook dicts if both are empty (a user's hook registered before keeps the plain dicts:
    its handle holds them). Returns the dicts to note amp_patch's hook ids in, or None."""
    if any(type(getattr(module, name)) is not OrderedDict or getattr(module, name) for name in _HOOK_DICTS):
        return None
    dicts = []
    for name in _HOOK_DICTS:
        quiet = QuietHooks(owner, module)
        object.__setattr__(module, name, quiet)
        dicts.append(quiet)
    return dicts


def restore(module):
    """deinitialize: an emptied quiet dict goes back to a plain one; one still holding a user's hook stays (its
    handle holds it) and reads as a plain dict, its owner being closed."""
    for name in _HOOK_DICTS:
        hooks = module.__dict__.get(name)
        if type(hooks) is QuietHooks and not len(hooks):
            object.__setattr__(module, name, OrderedDict())
