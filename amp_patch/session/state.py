"""The one owner of activation: the active session, the installed casting engine, and the lock they change under.

Apex's API is module-level, so there is one active session per process. Every change of the pointer (initialize's
commit, deinitialize, an ``autocast()`` region opening its own engine) happens under :data:`lock`, so a region
opened in one thread cannot interleave with an initialize in another. The casting layer never reads this module:
what it needs of activation (the live engine, a temporary region for a checkpoint recompute) reaches it as
:data:`ACTIVATION`, passed to each engine the session layer builds.

Also the one process-level option that exists before any session: Apex's
``_amp_state.allow_incoming_model_not_fp32`` (set by scripts before ``initialize``).
"""
import contextlib
import threading

from ..errors import UsageError

_active = {"session": None, "engine": None, "allow_incoming_model_not_fp32": False}
ACTIVE = _active  # (read-only outside this module: scale_loss reads the session without a call)
lock = threading.RLock()


def current():
    """The active session, or None."""
    return _active["session"]


def current_session(api):
    """The active session, or a UsageError naming ``api`` and the call that must come first."""
    session = _active["session"]
    if session is None:
        raise UsageError(f"amp_patch.{api}() was called before amp_patch.initialize(); call "
                         "model, optimizer = amp_patch.initialize(model, optimizer, opt_level=...) first")
    return session


def active_engine():
    """The installed casting engine (of the session or of an autocast region), or None."""
    return _active["engine"]


def activate(session=None, engine=None):
    with lock:
        _active["session"] = session
        _active["engine"] = engine


def deactivate():
    """No session. The engine goes with it unless it is an ``autocast()`` region's (opened inside an O0/O2/O3
    session, which has none): that region removes its own patches on exit."""
    with lock:
        session = _active["session"]
        if session is None or _active["engine"] is session.casting.engine:
            _active["engine"] = None
        _active["session"] = None


_unfinished = {}  # id -> an autocast() region's close that an interrupt (Ctrl-C) cut short


def closing(close):
    """``close`` (an ``autocast()`` region's undo) starts: kept until :func:`closed`, for :func:`finish_closes`."""
    _unfinished[id(close)] = close


def closed(close):
    _unfinished.pop(id(close), None)


def finish_closes():
    """Run again each region's close an interrupt cut short (``deinitialize()``: it finishes what is left)."""
    for close in list(_unfinished.values()):
        close()


def set_region_engine(engine):
    """An ``autocast()`` region's engine on (or, with None, off); the session, if any, stays the active one."""
    with lock:
        _active["engine"] = engine


@contextlib.contextmanager
def reopened(engine):
    """A temporary region with ``engine``'s op table and dtype, while no other engine is active (checkpoint
    recomputation during a backward that runs after its forward's region closed)."""
    fresh = type(engine)(engine.table, half_dtype=engine.half_dtype, allow_banned=engine.allow_banned,
                         registrations=engine.registrations, activation=engine.activation)
    with lock:
        fresh.install()
        set_region_engine(fresh)
    try:
        yield fresh
    finally:
        with lock:
            set_region_engine(None)
            fresh.uninstall()


class _Activation:
    """What an engine may ask of activation (injected: the casting layer imports nothing of the session's)."""

    active_engine = staticmethod(active_engine)
    reopened = staticmethod(reopened)


ACTIVATION = _Activation()


def allow_incoming_model_not_fp32():
    """Apex's process-wide switch: ``initialize`` accepts models that already hold half params/buffers."""
    return _active["allow_incoming_model_not_fp32"]


def set_allow_incoming_model_not_fp32(value):
    _active["allow_incoming_model_not_fp32"] = bool(value)
