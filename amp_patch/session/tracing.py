"""``amp_patch.trace()``: record the active engine's casts for a region (the :class:`Tracer` lives in observe/)."""
import contextlib

from ..errors import UsageError
from ..observe.trace import Tracer, UnpatchedCalls, running_modules
from . import state as _state


@contextlib.contextmanager
def trace(modules=True, unpatched=True):
    """Record every call of a patched entry point in the body; yields the :class:`Tracer`."""
    engine = _state.active_engine()
    if engine is None:
        raise UsageError("amp_patch.trace() needs O1 casting: call amp_patch.initialize(..., opt_level='O1') or "
                         "open an amp_patch.autocast() region first")
    tracer = Tracer(modules=modules, unpatched=unpatched)
    with contextlib.ExitStack() as stack:
        previous = engine.tracer
        _retrace(engine, tracer)
        stack.callback(_retrace, engine, previous)
        if modules:
            stack.enter_context(running_modules(_module_names(), tracer.module_stack))
        if unpatched:
            originals = {id(p.original) for p in engine.patcher.patches}
            stack.enter_context(UnpatchedCalls(tracer, originals))
        yield tracer


def _retrace(engine, tracer):
    engine.retrace(tracer)
    session = _state.current()
    if session is not None and session.casting.engine is engine:
        session.refresh_early_bound()


def _module_names():
    session = _state.current()
    names = {}
    for model in getattr(session, "models", []):
        for name, module in model.named_modules():
            names.setdefault(id(module), name or type(module).__name__)
    return names
