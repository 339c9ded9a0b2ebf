"""The one pointer to the active session (Apex's API is module-level) and its casting engine."""
_active = {"session": None, "engine": None}


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
    _active["session"] = None
    _active["engine"] = None
