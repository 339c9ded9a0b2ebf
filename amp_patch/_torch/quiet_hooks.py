"""Hook dicts of O2's inner owners that read empty inside a call the model started, so torch's fast call path runs.

Every module owning cast params carries O2's :class:`~amp_patch.weights.call_hooks.Install` /
:class:`~amp_patch.weights.call_hooks.Restore` pair for a call it may start itself (a submodule called on its own, a
checkpointed layer). Inside a call the model started (its forward calling its layers) the pair has nothing to do,
yet a module with any forward hook takes torch's slow call path (``_call_impl``'s hook loops; about 6 us a call in
a training step). So an owner whose two hook dicts held nothing at initialize gets an :class:`InsideModelCall` for
each: a ``dict`` that reads false (``bool``, which ``_call_impl`` tests) exactly while this thread's call in
progress was started by the model itself and the dict holds only amp_patch's pair; true otherwise (no call in the
thread, a call a module started on its own, dynamo tracing, a hook of the user's added, the session over), and
torch's slow path runs the hooks as a plain dict's. The test does not depend on which module is being called: a
dict shared with another module (``copy.copy`` of a layer, a library assigning one module's hook dicts to
another) reads the same for both. Iterating, indexing, ``copy()``, ``|`` and handles are a plain ``OrderedDict``'s;
copies and pickles of the module get plain dicts. :func:`restore` gives an emptied dict back plain; one still
holding a user's hook stays (its handle holds it) and drops its references to the session, reading as a plain
dict from then on.
"""
from collections import OrderedDict

from .compat import tracing

_compiling = tracing
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")


class InsideModelCall(OrderedDict):
    """``_forward_pre_hooks`` / ``_forward_hooks`` of an O2 inner owner; ``owner`` is the model's
    :class:`~amp_patch.weights.compute_copies.ComputeCopies`, ``own`` the ids of its hooks here."""

    mine = None  # the id of amp_patch's one hook in this dict (set once it is registered)

    def __init__(self, owner):
        super().__init__()
        self.owner, self.own = owner, set()

    def __bool__(self):
        n = len(self)
        if not n:
            return False
        owner = self.owner
        if owner is None or not owner.live:
            return True
        if n == 1:  # (the usual dict: amp_patch's one hook; a membership test costs less than comparing key sets)
            if self.mine not in self:
                return True
        elif n > len(self.own) or not self.keys() <= self.own:
            return True
        call = owner.call
        return not (call.depth and call.called is owner.model and not _compiling())

    def copy(self):
        return OrderedDict(self)

    def __or__(self, other):
        return OrderedDict(self) | other

    def __ror__(self, other):
        merged = OrderedDict(other)
        merged.update(self)
        return merged

    def __reduce__(self):  # (pickles and copies of the model get torch's plain dicts)
        return OrderedDict, (list(self.items()),)

    def __deepcopy__(self, memo):
        import copy
        return OrderedDict((key, copy.deepcopy(hook, memo)) for key, hook in self.items())


def quieten(module, owner):
    """Give ``module`` quiet hook dicts if both are empty plain dicts (a user's hook registered before keeps the
    plain dicts: its handle holds them). Returns the two dicts (note amp_patch's hook ids in ``own``) or None."""
    if any(type(getattr(module, name)) is not OrderedDict or getattr(module, name) for name in _HOOK_DICTS):
        return None
    dicts = []
    for name in _HOOK_DICTS:
        quiet = InsideModelCall(owner)
        object.__setattr__(module, name, quiet)
        dicts.append(quiet)
    return dicts


def restore(module):
    """The session is over: an emptied quiet dict goes back to a plain one; one still holding a user's hook stays
    (its handle holds it) and lets the session go."""
    for name in _HOOK_DICTS:
        hooks = module.__dict__.get(name)
        if isinstance(hooks, InsideModelCall):
            if len(hooks):
                hooks.owner = None
            else:
                object.__setattr__(module, name, OrderedDict())
