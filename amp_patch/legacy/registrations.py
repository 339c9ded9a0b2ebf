"""Apex's ``amp.register_{half,float,promote}_function``: as amp_patch's, except after ``amp.initialize``.

Apex recorded every registration for the next ``amp.init()`` (which ``initialize`` ran), so one made after
``initialize`` changed nothing until the next ``initialize`` and raised nothing. Under Apex's API amp_patch does
the same: the registration waits for the next ``initialize``, with one WARNING saying that the open session does
not cast it. (amp_patch's own ``register_*_function`` refuses it with a ``UsageError`` naming the fix.)
"""
import logging

from ..session import state as _state
from ..session.user_functions import REGISTRY

log = logging.getLogger("amp_patch")


def _register(module, name, category):
    api = f"amp.register_{category}_function"
    REGISTRY.add(module, name, category, api, after_initialize="defer")
    if _state.current() is not None:
        owner = getattr(module, "__name__", repr(module))
        log.warning("%s(%s, %r) after amp.initialize(): as in Apex it applies from the next amp.initialize(); "
                    "the open session does not cast it (register before amp.initialize to cast it now)",
                    api, owner, name)


def register_half_function(module, name):
    """Run ``module.name`` in the half dtype under O1 (after ``initialize``: from the next one, as in Apex)."""
    _register(module, name, "half")


def register_float_function(module, name):
    """Run ``module.name`` in float32 under O1 (after ``initialize``: from the next one, as in Apex)."""
    _register(module, name, "float")


def register_promote_function(module, name):
    """Run ``module.name`` in the widest floating dtype of its args under O1 (after ``initialize``: from the next
    one, as in Apex)."""
    _register(module, name, "promote")
