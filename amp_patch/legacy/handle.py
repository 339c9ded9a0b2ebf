"""Apex's old handle API on amp_patch's engine.

``handle = amp.init(...)`` turns on O1 casting (as ``initialize`` with
``opt_level="O1"`` and no models); ``optimizer = handle.wrap_optimizer(optimizer,
num_loss=N)`` returns a wrapper whose ``scale_loss(loss)`` uses one dynamic (or
static) loss scaler per loss, in call order, between two ``step()`` calls; a step
after an overflow in any of them is skipped. ``handle.scale_loss(loss, optimizer)``
(the oldest form) uses the handle's own scaler, which ``amp.state_dict()`` reports.
``handle._deactivate()`` undoes everything (as ``amp_patch.deinitialize()``).
"""
import contextlib
import logging

from .._torch import dist as distributed
from ..errors import UsageError
from ..scaling.optimizer_state import OptimizerState
from ..scaling.scaler import LossScaler
from ..session import state as _state
from ..session.api import deinitialize
from . import messages, stacking
from .amp_state import view_of
from .unsupported import attribute_error

log = logging.getLogger("amp_patch")


def init(enabled=True, loss_scale="dynamic", enable_caching=True, verbose=False, allow_banned=False):
    """Apex's ``amp.init()``: O1 casting now, loss scaling through the returned handle.

    ``enable_caching`` is accepted and ignored: amp_patch's cast cache is always
    on and invalidates a cached weight cast when the weight changes.
    """
    if not enabled:
        return NoOpHandle()
    call = {"opt_level": "O1", "loss_scale": loss_scale, "verbosity": 1 if verbose else 0,
            "allow_banned": allow_banned}
    session = _state.current()
    if session is not None and stacking.record(session)["handles"]:
        raise UsageError("amp.init() was called while amp_patch is already initialized by an earlier amp.init() "
                         "(its handle is active); call handle._deactivate() (or amp_patch.deinitialize()) before "
                         "calling amp.init() again")
    if session is not None and stacking._compatible(session, call):
        return _bind(session, enable_caching, verbose)  # amp.init() after an O1 amp.initialize(): both stay active
    if session is not None:
        stacking._close_incompatible(session, call)
    stacking.open_apex_session([], None, stacking.with_list_edits(call))
    stacking.record(_state.current())["calls"] = dict(call)
    return _bind(_state.current(), enable_caching, verbose)


def _bind(session, enable_caching, verbose):
    """A handle on ``session``, remembered so that a later ``amp.initialize`` that rebuilds it keeps it active."""
    handle = AmpHandle(session, enable_caching=enable_caching, verbose=verbose)
    stacking.record(session)["handles"].append(handle)
    return handle


@contextlib.contextmanager
def _scaled(session, state, scaler, loss):
    """One loss through one scaler for one optimizer: scale, then unscale, check and update on exit."""
    state.before_backward(scaler)
    yield loss.float() * scaler.scale
    found = distributed.agree_overflow(state.after_backward(scaler, False))
    if scaler.update(found):
        state.doom()
    session.clear_cache()


class AmpHandle:
    """What ``amp.init()`` returns while enabled."""

    def __init__(self, session, *, enable_caching=True, verbose=False):
        self._session = session
        self._enable_caching = bool(enable_caching)
        self._verbose = bool(verbose)

    def is_active(self):
        return _state.current() is self._session

    @property
    def has_cache(self):
        return self._enable_caching

    @property
    def verbose(self):
        return self._verbose

    def _require_active(self, api):
        if not self.is_active():
            raise UsageError(f"handle.{api}() after the handle was deactivated (handle._deactivate() or "
                             "amp_patch.deinitialize()); call amp.init() again")
        return self._session

    def attach(self, optimizer):
        """Register ``optimizer`` with the session (idempotent); returns its amp_patch state."""
        session = self._require_active("wrap_optimizer")
        state = session.scaling.opt_states.get(id(optimizer))
        if state is None or state.optimizer is not optimizer:
            state = OptimizerState(optimizer, master_weights=False)
            session.scaling.opt_states[id(optimizer)] = state
            session.undo.append(state.restore)  # (its step hooks go with the session)
        return state

    def wrap_optimizer(self, optimizer, num_loss=1):
        """An optimizer wrapper with ``scale_loss(loss)`` and one loss scaler per loss (``num_loss``)."""
        return OptimWrapper(optimizer, self, num_loss)

    def new_scaler(self, loss_id):
        return LossScaler(self._session.props.loss_scale, loss_id=loss_id)

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizer):
        """The oldest form: ``with handle.scale_loss(loss, optimizer) as scaled: scaled.backward()``."""
        if isinstance(optimizer, OptimWrapper):
            optimizer = optimizer.optimizer
        state = self.attach(optimizer)
        with _scaled(self._session, state, self._session.scaling.scalers[0], loss) as scaled:
            yield scaled

    def _clear_cache(self):
        if self.is_active():
            self._session.clear_cache()

    def remove_cache(self, param):
        """Apex dropped one param's cached cast; amp_patch drops them all (they are rebuilt on use)."""
        self._clear_cache()

    def _deactivate(self):
        if self.is_active():
            deinitialize()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "_default_scaler":  # Apex's handle.scale_loss scaler: here the session's scaler 0
            return view_of(self._require_active("_default_scaler").scaling.scalers[0])
        raise attribute_error(f"amp.AmpHandle.{name}")


class NoOpHandle:
    """What ``amp.init(enabled=False)`` returns: everything passes through."""

    def is_active(self):
        return False

    has_cache = False
    verbose = False

    def wrap_optimizer(self, optimizer, num_loss=1):
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizer):
        yield loss

    def _clear_cache(self):
        pass

    def remove_cache(self, param):
        pass

    def _deactivate(self):
        pass


class OptimWrapper:
    """``handle.wrap_optimizer(optimizer, num_loss)``: the optimizer plus per-loss scaling.

    Every attribute not defined here (``zero_grad``, ``state_dict``, ``param_groups``, ...)
    is the wrapped optimizer's.
    """

    def __init__(self, optimizer, handle, num_loss=1):
        if isinstance(num_loss, bool) or not isinstance(num_loss, int) or num_loss < 1:
            raise UsageError(f"wrap_optimizer(num_loss={num_loss!r}); pass the number of losses scaled before "
                             "each step(), a positive integer")
        self.optimizer = optimizer
        self._handle = handle
        self._num_loss = num_loss
        self._loss_idx = 0
        self._scalers = []
        if handle.is_active():
            handle.attach(optimizer)
            self._scalers = [handle.new_scaler(i) for i in range(num_loss)]

    @contextlib.contextmanager
    def scale_loss(self, loss):
        """Scale ``loss`` with the next of this optimizer's ``num_loss`` scalers."""
        if not self._handle.is_active():
            yield loss
            return
        if self._loss_idx >= self._num_loss:
            raise UsageError(f"scale_loss() was called {self._loss_idx + 1} times before step(), but "
                             f"wrap_optimizer(num_loss={self._num_loss}); pass num_loss={self._loss_idx + 1}")
        scaler = self._scalers[self._loss_idx]
        self._loss_idx += 1
        state = self._handle.attach(self.optimizer)  # (a later amp.initialize may have rebuilt the session)
        with _scaled(self._handle._session, state, scaler, loss) as scaled:
            yield scaled

    def step(self, closure=None):
        """Step (skipped, leaving params and optimizer state unchanged, after an overflow in any loss)."""
        if closure is not None and self._handle.is_active():
            raise UsageError("optimizer.step(closure) is not supported by the amp wrapper (Apex did not support it "
                             "either); compute the loss, run scale_loss and backward, then call step() without "
                             "a closure")
        self._loss_idx = 0
        result = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        state = self._handle._session.scaling.opt_states.get(id(self.optimizer)) if self._handle.is_active() else None
        if state is not None and state.last_skipped:
            messages.maybe_print("Gradient overflow, skipping update", 1)  # Apex's, at its default verbosity
            return None
        return result

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    def __getattr__(self, name):
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self):
        return f"OptimWrapper({self.optimizer!r}, num_loss={self._num_loss})"
