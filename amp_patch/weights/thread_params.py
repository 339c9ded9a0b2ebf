"""O2's compute copies are visible only to the thread whose call made them.

A module holding params O2 casts gets a :class:`ThreadParams` as its ``_parameters``: a ``dict`` (same keys, the
fp32 params as values) with an overlay per thread. While a thread's call of the model is in progress, its half
copies sit in that thread's overlay: ``module.weight``, ``module._parameters[name]``, ``module.parameters()`` and
``state_dict()`` read *in that thread* give the copy; every other thread (a training thread clipping
``model.parameters()`` beside a background evaluation, a checkpoint writer) reads the fp32 params, as between
calls. Two threads can call the model at once, each on its own copies.

An assignment to a slot (``module._parameters[name] = t``, ``torch.func.functional_call``) goes to the shared
dict and drops the assigning thread's copy of that slot: the forward uses what it put there. ``copy.deepcopy`` and
pickling give a plain ``dict`` (a copy of the model is not part of the session). While dynamo traces a call
(``torch.compile``) the copies are put into the shared dict itself, as dynamo traces the hooks into the compiled
call: a compiled call is one thread's call.
"""
import threading

import torch

#: Counts the assignments to a slot (``__setitem__``, ``__delitem__``, ``pop``, in any thread): a call whose count
#: is unchanged since its copies went in still has its copies in their slots (the input cast's weight check then
#: reads only their dtypes: :meth:`~amp_patch.model.transform.WeightSlots.check`).
EDITS = [0]


class ThreadParams(dict):
    """``module._parameters`` of a module whose params O2 casts (see the module docstring)."""

    __slots__ = ("_local", "_owner")

    def __init__(self, params, owner=None):
        super().__init__(params)
        self._local = threading.local()
        self._owner = owner  # the ComputeCopies whose calls fill the overlay (items() asks it for a cut-off call)

    def overlay(self):
        """This thread's ``{name: copy}`` (created empty)."""
        found = getattr(self._local, "copies", None)
        if found is None:
            found = self._local.copies = {}
        return found

    def _copies(self):
        return getattr(self._local, "copies", None)

    def __getitem__(self, name):
        copies = getattr(self._local, "copies", None)
        if copies:
            found = copies.get(name)
            if found is not None:
                return found
        return dict.__getitem__(self, name)

    def get(self, name, default=None):
        copies = getattr(self._local, "copies", None)
        if copies:
            found = copies.get(name)
            if found is not None:
                return found
        return dict.get(self, name, default)

    def items(self):
        """(Read by ``state_dict()``, ``parameters()``, ``load_state_dict``.) A call of this thread cut off by
        Ctrl-C (no always-called hook ran) left its copies here: they go first, so a checkpoint saved after the
        interrupt holds the fp32 params, not their half copies."""
        copies = getattr(self._local, "copies", None)
        if not copies:
            return dict.items(self)
        owner = getattr(self, "_owner", None)
        if owner is not None and owner.cut_off():
            owner.drop_stale()
            return dict.items(self)
        return [(name, copies.get(name, value)) for name, value in dict.items(self)]

    def values(self):
        return [value for _, value in self.items()]

    def __setitem__(self, name, value):
        copies = getattr(self._local, "copies", None)
        EDITS[0] += 1
        if copies:
            copies.pop(name, None)
        dict.__setitem__(self, name, value)

    def __delitem__(self, name):
        copies = getattr(self._local, "copies", None)
        EDITS[0] += 1
        if copies:
            copies.pop(name, None)
        dict.__delitem__(self, name)

    def pop(self, name, *default):
        copies = getattr(self._local, "copies", None)
        EDITS[0] += 1
        if copies:
            copies.pop(name, None)
        return dict.pop(self, name, *default)

    def copy(self):
        return dict(self.items())

    def __reduce_ex__(self, protocol):
        return dict, (dict(self),)

    def __deepcopy__(self, memo):
        import copy
        return {name: copy.deepcopy(value, memo) for name, value in dict.items(self)}


def install(module, owner=None):
    """Give ``module`` a :class:`ThreadParams` (if it has not one); returns True if it got one now."""
    params = module.__dict__.get("_parameters")
    if params is None or isinstance(params, ThreadParams):
        return False
    module.__dict__["_parameters"] = ThreadParams(params, owner)
    return True


def uninstall(module):
    """Give ``module`` back a plain dict of its (shared) params."""
    params = module.__dict__.get("_parameters")
    if isinstance(params, ThreadParams):
        module.__dict__["_parameters"] = dict(dict.items(params))


def refresh_flat_weights(modules):
    """RNN modules read their weights from ``_flat_weights``, a list rebuilt from ``_parameters``."""
    for module in modules:
        if isinstance(module, torch.nn.RNNBase):
            module._init_flat_weights()
