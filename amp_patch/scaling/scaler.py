"""Loss scaling: one :class:`LossScaler` per loss id, plus gradient unscale helpers.

Dynamic scaling (Apex's algorithm plus hysteresis and bounds): every overflow
(non-finite grad) skips the step and resets the growth tracker; the hysteresis
tracker counts down and, once at 0 (after ``hysteresis`` consecutive overflows,
and on every further consecutive one), the scale is multiplied by
``backoff_factor``, floored at ``min_loss_scale``. A clean step resets the
hysteresis tracker; ``growth_interval`` consecutive clean steps multiply the
scale by ``growth_factor``, capped at ``max_loss_scale``. A static scale never
changes, but overflows still skip the step. ``update`` is pure Python on floats;
the unscale helpers do at most one host sync per call.
"""
import logging
import math
import time
from collections.abc import Mapping

from ..config.loss_scale import SCALE_FLOOR, check_hyperparameters, parse_loss_scale  # noqa: F401
from ..config.loss_scale import count as _count
from ..config.loss_scale import real as _real
from ..config.loss_scale import scale_value as _scale_value
from ..errors import ConfigError
from .unscale import unscale_, unscale_collected_, unscale_into  # noqa: F401 - re-exported

logger = logging.getLogger("amp_patch")

STATE_VERSION = 1
KEY_PREFIX = "loss_scaler"

_HYPER_KEYS = ("min_loss_scale", "max_loss_scale", "growth_factor", "backoff_factor",
               "growth_interval", "hysteresis")
_STATE_KEYS = frozenset(("loss_scale", "unskipped", "growth_tracker", "hysteresis_tracker", "dynamic",
                         "steps", "skipped_steps", "version") + _HYPER_KEYS)


class LossScaler:
    """Loss scale state for one loss id.

    ``loss_scale``: ``"dynamic"`` or a static number (float-like strings accepted).
    A dynamic scaler starts at ``init_scale`` clamped into
    ``[min_loss_scale, max_loss_scale]`` (Apex: ``min(2**16, max_loss_scale)``).
    Overflow lines go to ``logging.getLogger("amp_patch")``, at most one per
    ``log_interval`` seconds per scaler (0: every overflow), INFO for routine
    dynamic back-offs, WARNING for a static scaler or a scale stuck at its floor.
    The knobs are read-only after construction (``load_state_dict`` restores them).
    Public state: ``loss_id``, ``scale``, ``dynamic``, ``hyperparameters``, and the
    counters ``steps``, ``skipped_steps`` and ``last_overflow`` (set by :meth:`update`).
    """

    _clock = staticmethod(time.monotonic)

    def __init__(self, loss_scale="dynamic", *, loss_id=0, init_scale=2.0 ** 16, min_loss_scale=None,
                 max_loss_scale=2.0 ** 24, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 hysteresis=1, log_interval=10.0):
        static = parse_loss_scale(loss_scale)
        self.loss_id = _count("loss_id", loss_id, 0, "Loss ids are 0, 1, ... num_losses - 1.")
        hp = check_hyperparameters(min_loss_scale, max_loss_scale, growth_factor, backoff_factor,
                                   growth_interval, hysteresis)
        init = _scale_value("init_scale", init_scale, "The default is 2.**16.")
        self._log_interval = _real("log_interval", log_interval, lambda x: 0.0 <= x < math.inf,
                                   "a finite number of seconds >= 0", "0 logs every overflow.")
        self._dynamic = static is None
        self._set_hyperparameters(hp)
        self._scale = self._clamp(init) if self._dynamic else static
        self._growth_tracker = 0
        self._hysteresis_tracker = self._hysteresis
        self.steps = 0  # update() calls
        self.confirmed = 0  # the update count when an optimizer step that followed them completed (roll_back)
        self.holders = 0  # optimizer states holding a memento of this scaler for their coming step
        self.undone = []  # (first, end) update counts a roll_back undid, until the step history drops their records
        self.skipped_steps = 0  # overflows; every overflow skips its step
        self.last_overflow = False  # the latest update() saw an overflow
        self.deferred_overflow = None  # Apex's delay_overflow_check exits since the last update_scale(): any inf?
        self._last_log_time = None
        self._suppressed = 0

    def _set_hyperparameters(self, hp):
        self._hp = dict(hp)
        self._min, self._max = hp["min_loss_scale"], hp["max_loss_scale"]
        self._growth_factor, self._backoff_factor = hp["growth_factor"], hp["backoff_factor"]
        self._growth_interval, self._hysteresis = hp["growth_interval"], hp["hysteresis"]

    def _clamp(self, scale):
        return min(max(scale, self._min if self._min is not None else SCALE_FLOOR), self._max)

    @property
    def dynamic(self):
        """True for a dynamic scaler, False for a static one."""
        return self._dynamic

    def set_dynamic(self, dynamic):
        """Switch between dynamic and static scaling, keeping the current scale (Apex scripts set
        ``loss_scaler.dynamic``); a scale that becomes dynamic is clamped into its bounds."""
        self._dynamic = bool(dynamic)
        if self._dynamic:
            self._scale = self._clamp(self._scale)

    @property
    def scale(self):
        """The current loss scale, a Python float (reading it never syncs a device)."""
        return self._scale

    @property
    def hyperparameters(self):
        """The dynamic-scaling knobs as a dict (min/max_loss_scale, factors, interval, hysteresis)."""
        return dict(self._hp)

    def __repr__(self):
        kind = "dynamic" if self._dynamic else "static"
        return (f"LossScaler(loss_id={self.loss_id}, {kind}, scale={self._scale!r}, "
                f"steps={self.steps}, skipped_steps={self.skipped_steps})")

    def unscale_grads(self, grads, out=None):
        """Unscale ``grads`` by ``1/scale``; return True if any grad was inf/NaN.

        Without ``out`` the grads (tensors or None, collected by amp_patch: not type-checked) are unscaled in
        place (:func:`unscale_collected_`).
        With ``out`` (a list as long as ``grads``, for O2 fp32 master grads) the
        unscaled fp32 values are stored into / added to ``out`` (:func:`unscale_into`).
        At most one host sync per call. Does not change the scaler's state:
        pass the result to :meth:`update`.
        """
        if out is None:
            return unscale_collected_(grads, self._scale)
        return unscale_into(grads, out, self._scale)

    def memento(self):
        """What :meth:`update` changes, for :meth:`roll_back` (a step that never completed)."""
        return (self._scale, self._growth_tracker, self._hysteresis_tracker, self.steps, self.skipped_steps,
                self.last_overflow)

    def roll_back(self, memento):
        """Return to the state :meth:`memento` captured, unless an optimizer step completed after the updates since
        (:attr:`confirmed`: another optimizer of the same loss stepped; they stand)."""
        if self.confirmed > memento[3]:
            return
        self.undone.append((memento[3], self.steps))
        (self._scale, self._growth_tracker, self._hysteresis_tracker, self.steps, self.skipped_steps,
         self.last_overflow) = memento

    def update(self, found_inf, mementos=None):
        """Advance the state machine after one unscale; return True if the step must be skipped. ``mementos`` (a
        dict, optional): a clean update first keeps this scaler's :meth:`memento` there, unless it holds one
        already (the steady scale_loss exit's ``note_update``, without the two calls)."""
        if mementos is not None and not found_inf and self not in mementos:
            mementos[self] = (self._scale, self._growth_tracker, self._hysteresis_tracker, self.steps,
                              self.skipped_steps, self.last_overflow)  # (memento)
            self.holders += 1  # (OptimizerState.note_update's count)
        self.steps += 1
        if not found_inf:
            self.last_overflow = False
            if self._suppressed:
                self._report_suppressed()
            self._hysteresis_tracker = self._hysteresis
            self._growth_tracker += 1
            if self._dynamic and self._growth_tracker >= self._growth_interval:
                self._scale = min(self._scale * self._growth_factor, self._max)
                self._growth_tracker = 0
            return False
        self.last_overflow = True
        self.skipped_steps += 1
        self._growth_tracker = 0
        old = self._scale
        if self._dynamic:
            self._hysteresis_tracker = max(self._hysteresis_tracker - 1, 0)
            if self._hysteresis_tracker == 0:
                floor = self._min if self._min is not None else SCALE_FLOOR
                self._scale = max(old * self._backoff_factor, floor)
        self._log_overflow(old)
        return True

    def _overflow_message(self, old):
        head = f"Gradient overflow: skipping step, loss scaler {self.loss_id}"
        if not self._dynamic:
            return logging.WARNING, f"{head} keeping static loss scale {old!r}"
        if self._scale != old:
            return logging.INFO, f"{head} reducing loss scale from {old!r} to {self._scale!r}"
        if self._hysteresis_tracker > 0:
            return logging.INFO, (f"{head} keeping loss scale {old!r} (hysteresis: reduced after "
                                  f"{self._hysteresis_tracker} more consecutive overflow(s))")
        return logging.WARNING, f"{head} keeping loss scale {old!r} (already at min_loss_scale)"

    def _log_overflow(self, old):
        level, message = self._overflow_message(old)
        if not logger.isEnabledFor(level):
            return
        now = self._clock()
        if self._last_log_time is not None and now - self._last_log_time < self._log_interval:
            self._suppressed += 1
            return
        if self._suppressed:
            message += (f" ({self._suppressed} similar message(s) suppressed in the last "
                        f"{now - self._last_log_time:.1f} s; {self.skipped_steps} step(s) skipped by this scaler "
                        "in all)")
        logger.log(level, message)
        self._last_log_time = now
        self._suppressed = 0

    def _report_suppressed(self):
        """A clean step after rate-limited overflow messages: say how many were not logged (once the interval
        has passed), so the log never undercounts the skipped steps."""
        if not self._suppressed or self._clock() - self._last_log_time < self._log_interval:
            return
        logger.info("loss scaler %d: %d more overflow-skipped step(s) after the last 'Gradient overflow' message "
                    "were not logged (rate limit: one message per %g s); %d step(s) skipped by this scaler in all",
                    self.loss_id, self._suppressed, self._log_interval, self.skipped_steps)
        self._last_log_time = self._clock()
        self._suppressed = 0

    def state_dict(self):
        """Return the full state: Apex's ``loss_scale``/``unskipped`` plus amp_patch's keys."""
        state = {"loss_scale": self._scale, "unskipped": self._growth_tracker,
                 "growth_tracker": self._growth_tracker, "hysteresis_tracker": self._hysteresis_tracker,
                 "dynamic": self._dynamic, "steps": self.steps, "skipped_steps": self.skipped_steps,
                 "version": STATE_VERSION}
        state.update(self.hyperparameters)
        return state

    def load_state_dict(self, state_dict):
        """Restore a dict from :meth:`state_dict` or Apex's ``{"loss_scale", "unskipped"}``.

        Saved knobs (factors, interval, bounds) replace this scaler's, as with
        ``torch.amp.GradScaler``; keys absent from the dict keep their current
        value. Nothing changes unless the whole dict is valid (ConfigError).
        """
        self._apply_state(self._parse_state(state_dict))

    def _parse_state(self, sd):
        where = f"loss scaler {self.loss_id} state dict"
        _check_state_keys(sd, where)
        if sd.get("version", STATE_VERSION) not in (1, 1.0):
            raise ConfigError(f"{where}: version={sd['version']!r} is not supported (this amp_patch writes "
                              f"version {STATE_VERSION}); it was saved by a newer amp_patch.")
        if "dynamic" in sd and bool(sd["dynamic"]) != self._dynamic:
            saved, here = ("dynamic", "static") if sd["dynamic"] else ("static", "dynamic")
            raise ConfigError(f"{where}: the checkpoint was saved by a {saved} loss scaler but this session's "
                              f"scaler is {here}; pass a matching loss_scale to initialize, or drop "
                              f"'{KEY_PREFIX}{self.loss_id}' from the checkpoint to start fresh.")
        try:
            return self._parse_values(sd)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def _parse_values(self, sd):
        hp = self.hyperparameters
        hp.update((k, sd[k]) for k in _HYPER_KEYS if k in sd)
        hp = check_hyperparameters(**hp)
        new = {"hp": hp, "scale": _scale_value("loss_scale", sd["loss_scale"])}
        trackers = [sd[k] for k in ("unskipped", "growth_tracker") if k in sd]
        if len(trackers) == 2 and trackers[0] != trackers[1]:
            raise ConfigError(f"unskipped={trackers[0]!r} and growth_tracker={trackers[1]!r} disagree; "
                              f"they are the same counter.")
        new["growth_tracker"] = _count("unskipped", trackers[0], 0) if trackers else 0
        hyst = _count("hysteresis_tracker", sd.get("hysteresis_tracker", hp["hysteresis"]), 0)
        if hyst > hp["hysteresis"]:
            raise ConfigError(f"hysteresis_tracker={hyst} exceeds hysteresis={hp['hysteresis']}.")
        new["hysteresis_tracker"] = hyst
        new["skipped_steps"] = skipped = _count("skipped_steps", sd.get("skipped_steps", self.skipped_steps), 0)
        # (an Apex checkpoint has no step count: at least its unskipped updates ran, after the skipped ones)
        new["steps"] = _count("steps", sd.get("steps", max(self.steps, skipped + new["growth_tracker"])), 0)
        return new

    def _apply_state(self, new):
        self._set_hyperparameters(new["hp"])
        scale = new["scale"]
        if self._dynamic and self._clamp(scale) != scale:
            logger.warning("loss scaler %d: checkpoint loss scale %r lies outside [min_loss_scale, "
                           "max_loss_scale]; using %r", self.loss_id, scale, self._clamp(scale))
            scale = self._clamp(scale)
        self._scale = scale
        self.confirmed = 0  # (the loaded counts start afresh: nothing after them was confirmed or undone)
        self.undone = []
        self._growth_tracker = new["growth_tracker"]
        self._hysteresis_tracker = new["hysteresis_tracker"]
        self.steps = new["steps"]
        self.skipped_steps = new["skipped_steps"]
        self.last_overflow = False


def _check_state_keys(sd, where):
    if not isinstance(sd, Mapping):
        raise ConfigError(f"{where} must be a dict, got {type(sd).__name__}.")
    for key in sd:
        if key not in _STATE_KEYS:
            hint = ""
            if isinstance(key, str) and key.startswith(KEY_PREFIX):
                hint = (" This looks like the dict of all loss scalers; load it with amp_patch.load_state_dict "
                        "(or amp_patch.scaling.scaler.load_state_dict_into) instead.")
            raise ConfigError(f"{where}: unknown key {key!r}; allowed keys: {', '.join(sorted(_STATE_KEYS))}.{hint}")
    if "loss_scale" not in sd:
        raise ConfigError(f"{where}: missing required key 'loss_scale' (keys present: "
                          f"{', '.join(map(repr, sd)) or 'none'}).")


def state_dict_for(scalers):
    """Return ``{"loss_scaler0": ..., "loss_scaler1": ...}`` (Apex's layout) for ``scalers`` in order."""
    return {f"{KEY_PREFIX}{i}": scaler.state_dict() for i, scaler in enumerate(scalers)}


def _checkpoint_indices(sd, expected):
    if not isinstance(sd, Mapping):
        raise ConfigError(f"the amp state dict must be a dict, got {type(sd).__name__}.")
    indices = {}
    for key in sd:
        suffix = key[len(KEY_PREFIX):] if isinstance(key, str) and key.startswith(KEY_PREFIX) else ""
        if not (suffix.isdigit() and str(int(suffix)) == suffix):
            hint = ""
            if key in _STATE_KEYS:
                hint = " This looks like a single loss scaler's state dict; wrap it as {'loss_scaler0': ...}."
            raise ConfigError(f"unexpected key {key!r} in the amp state dict; expected {expected} "
                              f"(one per loss, as written by amp_patch.state_dict()).{hint}")
        indices[int(suffix)] = key
    for i in range(len(indices)):
        if i not in indices:
            raise ConfigError(f"the amp state dict has keys {', '.join(sorted(map(repr, sd)))} but is missing "
                              f"'{KEY_PREFIX}{i}'; loss scaler keys must be numbered 0, 1, 2, ...")
    return indices


def load_state_dict_into(scalers, sd):
    """Load ``{"loss_scaler0": ..., ...}`` into ``scalers`` (in order), all or nothing.

    Raises ConfigError for a non-dict, a key that is not ``loss_scalerN``, a gap
    in the numbering, a count that differs from ``len(scalers)``, or any
    invalid per-scaler dict (nothing is loaded then).
    """
    scalers = list(scalers)
    n = len(scalers)
    expected = f"keys '{KEY_PREFIX}0'..'{KEY_PREFIX}{n - 1}'" if n else "no loss scaler keys"
    indices = _checkpoint_indices(sd, expected)
    if len(indices) != n:
        raise ConfigError(f"the checkpoint has {len(indices)} loss scaler(s) but this session has {n}; "
                          f"pass num_losses={len(indices)} to initialize to match the checkpoint.")
    parsed = [scaler._parse_state(sd[indices[i]]) for i, scaler in enumerate(scalers)]
    for scaler, new in zip(scalers, parsed):
        scaler._apply_state(new)
