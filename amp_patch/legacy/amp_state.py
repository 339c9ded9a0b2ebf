"""``apex.amp._amp_state``: a live view of amp_patch's session in the shape Apex's unit tests and scripts read.

Nothing is stored here: every read goes to the active session (``amp_patch.session.state``),
every write goes to the live object it names.

- ``loss_scalers[i]``: the session's loss scaler ``i`` as Apex's plain LossScaler object (see
  :class:`ScalerView`): Apex's attributes read and write the scaler, other attributes a script sets are kept;
  ``._overflow_buf`` and ``.update_scale()`` serve NVIDIA BERT's post-accumulation all-reduce recipe.
- ``handle._deactivate()``: ``amp_patch.deinitialize()`` (a no-op without a session); ``handle.is_active()``.
- ``opt_properties.opt_level`` / ``.loss_scale`` / ``.master_weights`` / ...: the resolved options (read only).
- ``allow_incoming_model_not_fp32`` (read and write): the switch ``initialize`` honours before refusing a
  model that arrives in half.
- ``min_loss_scale`` / ``max_loss_scale``: scaler 0's bounds.
"""
import weakref

import torch

from ..errors import NotInitializedError, UsageError
from ..session import state as _state
from ..session.accessors import master_params as _master_params
from ..session.api import deinitialize
from ..session.step_outcome import record_update, warming_up
from .messages import maybe_print as _print
from .unsupported import attribute_error

_PROPERTY_NAMES = ("opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
                   "master_weights", "loss_scale", "cast_model_outputs", "half_dtype", "keep_fp32_modules")


def _session(what):
    session = _state.current()
    if session is None:
        raise NotInitializedError(f"apex.amp._amp_state.{what} was read before amp.initialize(); it exists once "
                                  "amp.initialize(...) (or amp.init()) has run, until amp_patch.deinitialize()")
    return session


def master_params(optimizer):
    """Apex's ``amp.master_params``: the params ``optimizer`` updates (O2: the fp32 masters). Like Apex's (a loop
    over ``param_groups``) it works before or without ``initialize`` and for optimizers it was not given."""
    session = _state.current()
    if session is not None and session.enabled and session.scaling.opt_states.get(id(optimizer)) is not None:
        return _master_params(optimizer)
    return (p for group in optimizer.param_groups for p in group["params"])


# Apex's LossScaler attributes that map onto amp_patch's scaler: name -> the scaler's state_dict key.
_MAPPED = {"_loss_scale": "loss_scale", "_unskipped": "unskipped", "_scale_seq_len": "growth_interval",
           "_max_loss_scale": "max_loss_scale", "_min_loss_scale": "min_loss_scale"}
_VIEWS = weakref.WeakKeyDictionary()  # scaler -> its view, so a script's own attributes survive a re-read


def view_of(scaler):
    """The one :class:`ScalerView` of ``scaler`` (what ``_amp_state.loss_scalers[i]`` returns)."""
    view = _VIEWS.get(scaler)
    if view is None:
        view = _VIEWS[scaler] = ScalerView(scaler)
    return view


class ScalerView:
    """``_amp_state.loss_scalers[i]``: Apex's plain LossScaler object on amp_patch's live scaler.

    Apex's attributes (``_loss_scale``, ``_unskipped``, ``_scale_seq_len`` = the growth interval,
    ``_max_loss_scale``, ``_min_loss_scale``, ``dynamic``, ``_has_overflow``, ``_overflow_buf``) read and write
    the scaler (a bad value raises ConfigError and changes nothing); any other attribute a script sets is kept
    on this view, as Python would keep it on Apex's object (NVIDIA BERT sets ``_overfloat_buf``, its typo).
    Apex's methods (``loss_scale()``, ``update_scale()``, ``clear_overflow_state()``) cannot be overwritten.
    """

    def __init__(self, scaler):
        object.__setattr__(self, "_scaler", scaler)

    def loss_scale(self):
        return self._scaler.scale

    @property
    def dynamic(self):
        return self._scaler.dynamic

    @dynamic.setter
    def dynamic(self, value):
        self._scaler.set_dynamic(bool(value))

    @property
    def _has_overflow(self):
        return self._scaler.last_overflow

    @_has_overflow.setter
    def _has_overflow(self, value):
        self._scaler.last_overflow = bool(value)

    @property
    def _overflow_buf(self):
        """Apex's int flag tensor; a script may swap in its own (NVIDIA BERT's ``--allreduce_post_accumulation``)
        and then call :meth:`update_scale`. By default it holds the last overflow."""
        buf = vars(self).get("_buf")
        return buf if buf is not None else torch.tensor([int(self._scaler.last_overflow)], dtype=torch.int)

    @_overflow_buf.setter
    def _overflow_buf(self, value):
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise UsageError(f"_amp_state.loss_scalers[{self._scaler.loss_id}]._overflow_buf = {value!r}: it must "
                             "be a one-element tensor (Apex's int flag, nonzero after an overflow)")
        vars(self)["_buf"] = value

    def clear_overflow_state(self):
        """Apex's ``clear_overflow_state()``: no overflow pending (a script's own ``_overflow_buf`` is zeroed)."""
        self._scaler.last_overflow = False
        buf = vars(self).get("_buf")
        if buf is not None:
            buf.zero_()

    def update_scale(self):
        """Apex's ``update_scale()``: True when the step must be skipped. amp_patch's ``scale_loss`` exit already
        updated the scaler for this iteration; an overflow only the script's own ``_overflow_buf`` saw (e.g. in
        its post-accumulation all-reduce) is added now: the scale backs off and the session's next steps are
        skipped. Without a new overflow nothing changes (no double counting). After exits with
        ``delay_overflow_check=True`` (which updated nothing, as in Apex) this is the one update: an overflow those
        exits or the buffer saw backs off and skips, a clean one counts."""
        buf = vars(self).get("_buf")
        seen = buf is not None and bool(buf.item())
        deferred, self._scaler.deferred_overflow = self._scaler.deferred_overflow, None
        if deferred is not None:
            return self._update(deferred or seen)
        if self._scaler.last_overflow:
            return True
        return self._update(True) if seen else False

    def _update(self, found):
        session, scaler = _session("loss_scalers"), self._scaler
        before, warming = scaler.scale, warming_up(session, scaler, found)
        skip = scaler.update(found)
        if skip:
            for state in session.scaling.opt_states.values():
                state.doom(by=scaler)
        record_update(session, scaler, scaler.loss_id, before, skip, warming)
        return bool(found)

    def __getattribute__(self, name):
        if name in _MAPPED:
            return object.__getattribute__(self, "_scaler").state_dict()[_MAPPED[name]]
        return object.__getattribute__(self, name)

    def __setattr__(self, name, value):
        if name in _MAPPED:
            self._write(name, value)
        elif isinstance(getattr(type(self), name, None), property) or name.startswith("__"):
            object.__setattr__(self, name, value)
        elif callable(getattr(type(self), name, None)) or name in ("_scaler", "_buf"):
            raise UsageError(f"_amp_state.loss_scalers[{self._scaler.loss_id}].{name} cannot be set: it is "
                             "Apex's method (or amp_patch's link to the live scaler); set the attributes "
                             f"{', '.join(_MAPPED)}, dynamic, _has_overflow or _overflow_buf instead")
        else:
            vars(self)[name] = value  # a script's own attribute, kept as on Apex's plain object

    def _write(self, name, value):
        """Change the live scaler through its validated state_dict path (bad values raise ConfigError)."""
        state = self._scaler.state_dict()
        state[_MAPPED[name]] = value
        if name == "_unskipped":
            state["growth_tracker"] = value
        overflow = self._scaler.last_overflow
        self._scaler.load_state_dict(state)
        self._scaler.last_overflow = overflow

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise attribute_error(f"amp._amp_state.loss_scalers[{self._scaler.loss_id}].{name}")

    def __repr__(self):
        return f"<apex.amp._amp_state view of {self._scaler!r}>"


class PropertiesView:
    """``_amp_state.opt_properties``: the options ``initialize`` resolved (read only)."""

    def __init__(self, session):
        object.__setattr__(self, "_session", session)

    @property
    def enabled(self):
        return self._session.enabled

    @property
    def options(self):
        return {name: getattr(self, name) for name in ("enabled",) + _PROPERTY_NAMES}

    def __getattr__(self, name):
        if name in _PROPERTY_NAMES:
            props = self._session.props
            if props is None:
                return None
            if name == "master_weights" and props.opt_level == "O1" and not props.master_weights:
                return None  # (Apex's O1 left it unset: None, not False)
            return getattr(props, name)
        if name.startswith("__"):
            raise AttributeError(name)
        raise attribute_error(f"amp._amp_state.opt_properties.{name}")

    def __setattr__(self, name, value):
        raise UsageError(f"_amp_state.opt_properties.{name} is read only in amp_patch; pass {name}= to "
                         "amp.initialize(...) instead")


class HandleView:
    """``_amp_state.handle``: ``_deactivate()`` is ``amp_patch.deinitialize()``."""

    def _deactivate(self):
        deinitialize()

    def is_active(self):
        return _state.current() is not None

    def _clear_cache(self):
        session = _state.current()
        if session is not None:
            session.clear_cache()


class AmpStateView:
    """``apex.amp._amp_state``."""

    @property
    def loss_scalers(self):
        return [view_of(s) for s in _session("loss_scalers").scaling.scalers]

    @property
    def opt_properties(self):
        return PropertiesView(_session("opt_properties"))

    @property
    def handle(self):
        return HandleView()  # (also after deinitialize: a second _deactivate() is a no-op, as in Apex)

    @property
    def min_loss_scale(self):
        return self._scaler0("min_loss_scale")

    @property
    def max_loss_scale(self):
        return self._scaler0("max_loss_scale")

    def _scaler0(self, name):
        scalers = _session(name).scaling.scalers
        return scalers[0].hyperparameters[name] if scalers else None

    @property
    def verbosity(self):
        """The verbosity of the session's ``amp.initialize`` (1 without a session, as Apex's fresh AmpState)."""
        session = _state.current()
        return 1 if session is None else session.extensions.get("apex", {}).get("calls", {}).get("verbosity", 1)

    @property
    def allow_incoming_model_not_fp32(self):
        return _state.allow_incoming_model_not_fp32()

    @allow_incoming_model_not_fp32.setter
    def allow_incoming_model_not_fp32(self, value):
        _state.set_allow_incoming_model_not_fp32(value)

    def __setattr__(self, name, value):
        if name != "allow_incoming_model_not_fp32":
            raise UsageError(f"apex.amp._amp_state.{name} cannot be set in amp_patch (it is a view of the live "
                             "session); settable: allow_incoming_model_not_fp32 and the attributes of "
                             "loss_scalers[i] (e.g. _loss_scale, _scale_seq_len)")
        object.__setattr__(self, name, value)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if isinstance(getattr(type(self), name, None), property):
            _session(name)  # a property raised NotInitializedError: say so, not "unsupported"
        raise attribute_error(f"amp._amp_state.{name}")

    def __repr__(self):
        return "<apex.amp._amp_state: a view of amp_patch's active session>"


AMP_STATE = AmpStateView()


def maybe_print(msg, rank0=False):
    """Apex's ``apex.amp._amp_state.maybe_print``: ``msg`` on stdout when the session's verbosity is above 0 (with
    ``rank0``: on rank 0 only), as Apex printed it; scripts import it for their own lines."""
    _print(msg, AMP_STATE.verbosity, rank0)
__all__ = ["AMP_STATE", "master_params"]
