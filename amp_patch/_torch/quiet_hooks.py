"""Hook dicts that read empty where amp_patch's hooks in them have nothing to do, so torch's fast call path runs.

A module with any forward hook takes torch's slow call path (``_call_impl``'s hook loops; about 6 us a call in a
training step), even where the hooks return at once. amp_patch gives such a module, when both of its hook dicts
hold nothing of the user's, a :class:`QuietHooks` subclass for each: a ``dict`` that reads false (``bool``, which
``_call_impl`` tests) exactly where amp_patch's hooks in it would do nothing, and true otherwise (a hook of the
user's added since, dynamo tracing, the session over: the hooks then run as plain dicts' would). Iterating,
indexing and handles are the ``dict``'s. Copies and pickles of the module get plain dicts; :func:`restore` gives
an emptied one back plain (one still holding a user's hook stays: its handle holds it; it reads as a plain dict,
its session being over).

* :class:`InsideOthersCall`: O2's inner owners (``weights.call_hooks``' pair): quiet while this thread's call in
  progress was started by another module (the model's forward calling its layers).
* :class:`BehindCallThrough`: a model whose calls go through a :func:`call_through` (``_compiled_call_impl``,
  which torch's ``Module.__call__`` calls in place of ``_call_impl``): its hooks' work is done there; quiet while
  it is in place (``model.compile()`` replaces it: the hooks run again).
"""
from collections import OrderedDict

import torch

_compiling = torch.compiler.is_compiling
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")


class QuietHooks(OrderedDict):
    """A forward hook dict that reads empty where amp_patch's hooks in it (``own``: their ids) have nothing to do."""

    def __init__(self, owner, module):
        super().__init__()
        self.owner, self.module, self.own = owner, module, set()

    def __reduce__(self):  # (pickles and copies of the model get torch's plain dicts)
        return OrderedDict, (list(self.items()),)

    def __deepcopy__(self, memo):
        import copy
        return OrderedDict((key, copy.deepcopy(hook, memo)) for key, hook in self.items())


class InsideOthersCall(QuietHooks):
    """O2's inner owner: ``owner`` is its :class:`~amp_patch.weights.compute_copies.ComputeCopies`."""

    def __bool__(self):
        if not len(self):
            return False
        owner = self.owner
        if owner.live and len(self) <= len(self.own):
            call = owner.call
            if call.depth and call.called is not self.module and not _compiling() and self.keys() <= self.own:
                return False
        return True


class BehindCallThrough(QuietHooks):
    """A model called through ``owner`` (a :func:`call_through` function)."""

    def __bool__(self):
        if not len(self):
            return False
        owner = self.owner
        if owner.live and len(self) <= len(self.own) and self.module.__dict__.get("_compiled_call_impl") is owner \
                and not _compiling() and self.keys() <= self.own:
            return False
        return True


def call_through(module, begin, end):
    """A function for ``module._compiled_call_impl``: ``begin()``, torch's ``_call_impl`` (the module's hooks and
    forward), then ``end()`` (not when the call raises, as a forward hook). Its ``live`` attribute says whether
    its session is open. A plain function: copies and pickles of the module drop it (torch's
    ``Module.__getstate__`` leaves ``_compiled_call_impl`` out), and ``torch.jit.script`` passes over it (to the
    hooks, which refuse it naming the fix)."""
    call_impl = type(module)._call_impl

    def through(*args, **kwargs):
        begin()
        output = call_impl(module, *args, **kwargs)
        end()
        return output

    through.live = True
    return through


def quieten(module, kind, owner):
    """Give ``module`` quiet hook dicts of ``kind`` if both are empty plain dicts (a user's hook registered before
    keeps the plain dicts: its handle holds them). Returns the dicts (note amp_patch's hook ids in ``own``) or None."""
    if any(type(getattr(module, name)) is not OrderedDict or getattr(module, name) for name in _HOOK_DICTS):
        return None
    dicts = []
    for name in _HOOK_DICTS:
        quiet = kind(owner, module)
        object.__setattr__(module, name, quiet)
        dicts.append(quiet)
    return dicts


def restore(module):
    """An emptied quiet dict goes back to a plain one; one still holding a user's hook stays (its handle holds it)."""
    for name in _HOOK_DICTS:
        hooks = module.__dict__.get(name)
        if isinstance(hooks, QuietHooks) and not len(hooks):
            object.__setattr__(module, name, OrderedDict())
