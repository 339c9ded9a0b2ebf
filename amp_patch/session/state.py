"""The one pointer to the active session (Apex's API is module-level) and its casting engine.

Also the one process-level option that exists before any session: Apex's
``_amp_state.allow_incoming_model_not_fp32`` (set by scripts before ``initialize``).
"""
_active = {"session": None, "engine": None, "allow_incoming_model_not_fp32": False}


def current():
    """The active session, or None."""
    return _active["session"]


def active_engine():
    """The installed casting engine (of the session or of an autocast region), or None."""
    return _active["engine"]


def activate(session=None, engine=None):
    _active["session"] = session
    _active["engine"] = engine


def deactivate():
    """No session. The engine goes with it unless it is an ``autocast()`` region's (opened inside an O0/O2/O3
    session, which has none): that region removes its own patches on exit."""
    session = _active["session"]
    if session is None or _active["engine"] is getattr(session, "engine", None):
        _active["engine"] = None
    _active["session"] = None


def set_region_engine(engine):
    """An ``autocast()`` region's engine on (or, with None, off); the session, if any, stays the active one."""
    _active["engine"] = engine


def allow_incoming_model_not_fp32():
    """Apex's process-wide switch: ``initialize`` accepts models that already hold half params/buffers."""
    return _active["allow_incoming_model_not_fp32"]


def set_allow_incoming_model_not_fp32(value):
    _active["allow_incoming_model_not_fp32"] = bool(value)
