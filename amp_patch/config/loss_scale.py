"""Parsing the loss-scale arguments: ``loss_scale`` (``"dynamic"`` or a number) and the dynamic scaler's knobs.

The scaler's state machine (:mod:`amp_patch.scaling.scaler`) takes the parsed values; every check of a user's
number, with its message, is here.
"""
import difflib
import math
import numbers

from ..errors import ConfigError

#: Scales are kept inside [2**-126, 2**127] so that 1/scale is a normal fp32 number.
SCALE_FLOOR = 2.0 ** -126
SCALE_CEILING = 2.0 ** 127


def real(name, value, ok, expected, hint=""):
    """Return ``float(value)`` if it is a real number passing ``ok``; else raise ConfigError."""
    bad_type = isinstance(value, bool) or not isinstance(value, numbers.Real)
    if bad_type or not ok(float(value)):
        got = f", got {type(value).__name__}" if bad_type else ""
        raise ConfigError(f"{name}={value!r} is not valid: expected {expected}{got}. {hint}".rstrip())
    return float(value)


def scale_value(name, value, hint=""):
    return real(name, value, lambda x: SCALE_FLOOR <= x <= SCALE_CEILING,
                 "a positive finite number between 2**-126 and 2**127", hint)


def count(name, value, minimum, hint=""):
    return int(real(name, value, lambda x: x.is_integer() and x >= minimum, f"an integer >= {minimum}", hint))


def parse_loss_scale(value):
    """Return ``None`` for ``"dynamic"`` (any case), else the static scale as a float.

    Accepts a positive finite number or a float-like string such as ``"128.0"``.
    """
    hint = ("Pass loss_scale='dynamic' for dynamic loss scaling, or a static scale such as 128.0 "
            "(a float-like string such as '128.0' also works).")
    if not isinstance(value, str):
        return scale_value("loss_scale", value, hint)
    if value.strip().lower() == "dynamic":
        return None
    try:
        number = float(value)
    except ValueError:
        close = difflib.get_close_matches(value.strip().lower(), ["dynamic"], n=1, cutoff=0.6)
        hint = "Did you mean loss_scale='dynamic'? " * bool(close) + hint
        raise ConfigError(f"loss_scale={value!r} is not valid: expected 'dynamic' or a number. {hint}") from None
    if not SCALE_FLOOR <= number <= SCALE_CEILING:
        raise ConfigError(f"loss_scale={value!r} is not valid: expected a positive finite number between "
                          f"2**-126 and 2**127. {hint}")
    return number


def check_hyperparameters(min_loss_scale, max_loss_scale, growth_factor, backoff_factor,
                          growth_interval, hysteresis):
    """Validate the dynamic-scaling knobs; return them normalised, keyed by name."""
    swap = "Did you swap growth_factor and backoff_factor?"
    hp = {"min_loss_scale": None if min_loss_scale is None else scale_value(
              "min_loss_scale", min_loss_scale, "Pass None for no floor, or e.g. 1.0."),
          "max_loss_scale": scale_value("max_loss_scale", max_loss_scale,
                                         "The default is 2.**24; pass a larger finite value for a higher cap."),
          "growth_factor": real("growth_factor", growth_factor, lambda x: 1.0 < x < math.inf,
                                 "a finite number > 1 (the default is 2.0)", swap),
          "backoff_factor": real("backoff_factor", backoff_factor, lambda x: 0.0 < x < 1.0,
                                  "a number strictly between 0 and 1 (the default is 0.5)", swap),
          "growth_interval": count("growth_interval", growth_interval, 1, "The default is 2000."),
          "hysteresis": count("hysteresis", hysteresis, 1,
                               "1 backs off on every overflow; 2 waits for two overflows in a row.")}
    if hp["min_loss_scale"] is not None and hp["min_loss_scale"] > hp["max_loss_scale"]:
        raise ConfigError(f"min_loss_scale={min_loss_scale!r} is greater than max_loss_scale={max_loss_scale!r}; "
                          f"lower min_loss_scale or raise max_loss_scale.")
    return hp
