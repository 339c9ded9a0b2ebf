"""User registrations (Apex API): register_*_function, *_function decorators, disable_casts.

``register_*_function(module, name)`` records a wish before ``initialize``; the
next engine installs it (overriding an op-list entry for the same site). These
may name any module or class the user owns: the torch-only rule applies to op
lists, which are data, not to explicit Python calls.
"""
import contextlib
import dataclasses
import functools

from ..casting.wrappers import cast_call_args
from ..config.oplist import OpEntry
from ..errors import ConfigError, UsageError
from . import state as _state


@dataclasses.dataclass(frozen=True)
class Registration:
    owner: object
    entry: OpEntry


class Registry:
    """Registrations waiting for the next ``initialize``."""

    def __init__(self):
        self._items = {}

    def add(self, owner, name, category, api, after_initialize="raise"):
        """``after_initialize``: what a registration while a session is open does: "raise" (amp_patch's API), or
        "defer" (Apex's: kept for the next ``initialize``; the open session does not cast it)."""
        if not isinstance(name, str) or not hasattr(owner, name):
            owner_name = getattr(owner, "__name__", repr(owner))
            raise ConfigError(f"{api}({owner_name}, {name!r}): {owner_name} has no attribute {name!r}; pass the "
                              "module or class that defines the function and its exact name")
        if not callable(getattr(owner, name)):
            raise ConfigError(f"{api}: {name!r} is not callable")
        if _state.current() is not None and after_initialize == "raise":
            raise UsageError(f"{api} must be called before amp_patch.initialize(); call deinitialize() first or "
                             "move the registration above initialize()")
        qual = getattr(owner, "__name__", type(owner).__name__)
        entry = OpEntry(qual, name, category, f"<{api}>", 0)
        self._items[(id(owner), name)] = Registration(owner, entry)

    def take(self):
        """All pending registrations (they stay registered for later sessions, as in Apex)."""
        return tuple(self._items.values())

    def clear(self):
        self._items.clear()


REGISTRY = Registry()


def register_half_function(module, name):
    """Run ``module.name`` in the half dtype under O1 (call before ``initialize``)."""
    REGISTRY.add(module, name, "half", "register_half_function")


def register_float_function(module, name):
    """Run ``module.name`` in float32 under O1 (call before ``initialize``)."""
    REGISTRY.add(module, name, "float", "register_float_function")


def register_promote_function(module, name):
    """Run ``module.name`` in the widest floating dtype of its args under O1 (call before ``initialize``)."""
    REGISTRY.add(module, name, "promote", "register_promote_function")


def _decorator(category):
    def decorate(fn):
        if not callable(fn):
            raise ConfigError(f"{category}_function expects a callable, got {type(fn).__name__}")

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            engine = _state.active_engine()
            if engine is None or engine.disabled.here():
                return fn(*args, **kwargs)
            args, kwargs = cast_call_args(category, engine, args, kwargs)
            return fn(*args, **kwargs)

        return wrapper

    decorate.__name__ = f"{category}_function"
    decorate.__doc__ = f"Decorator: under O1 casting, cast the function's tensor args as a {category!r} op."
    return decorate


half_function = _decorator("half")
float_function = _decorator("float")
promote_function = _decorator("promote")


@contextlib.contextmanager
def disable_casts():
    """Turn O1 casting off in this thread for the body (re-entrant; restored even if the body raises)."""
    engine = _state.active_engine()
    if engine is None:
        yield
        return
    with engine.casts_disabled():
        yield
