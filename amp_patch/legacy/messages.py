"""Apex's printed lines, as Apex printed them, under the apex alias (``apex.amp.initialize`` / ``scale_loss``).

Apex used ``print`` (``_amp_state.maybe_print``), not ``logging``, and scripts and log scrapers grep its lines:

- ``amp.initialize`` (verbosity > 0, rank 0 only): "Selected optimization level O1:  Insert automatic casts
  ...", the defaults, "Processing user overrides ...", the options after the overrides (``"{:22} : {}"``);
- a step skipped after an overflow (verbosity > 0, every rank, as in Apex): "Gradient overflow.  Skipping step,
  loss scaler 0 reducing loss scale to 32768.0", printed by the skipped ``optimizer.step()``, naming the loss
  whose overflow skipped it and the scale after the back-offs;
- ``apex.fp16_utils.FP16_Optimizer``'s (its deprecation line, its ``verbose`` lines, "Gradient overflow.  Skipping
  step, reducing loss scale to X") and the old handle API's "Gradient overflow, skipping update", printed by
  their own modules through :func:`maybe_print`.

amp_patch's own API keeps ``logging`` (its records also carry a ``rank`` attribute, so a root-logger format with
``%(rank)s`` such as NVIDIA GNMT's formats them instead of printing ``--- Logging error ---``).
"""
import logging

import torch

from .._torch import dist as distributed
from ..session import state as _state

log = logging.getLogger("amp_patch")

# Apex's frontend.py: each opt level's brief (some end in a newline: Apex printed the blank line) and defaults.
_BRIEF = {"O0": "O0:  Pure FP32 training.\n",
          "O1": "O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n",
          "O2": "O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n",
          "O3": "O3:  Pure FP16 training."}
_DEFAULTS = {"O0": (torch.float32, False, None, False, 1.0), "O1": (None, True, None, None, "dynamic"),
             "O2": (torch.float16, False, True, True, "dynamic"), "O3": (torch.float16, False, False, False, 1.0)}
_OPTIONS = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights", "loss_scale")


class RankField(logging.Filter):
    """Gives amp_patch's log records a ``rank`` attribute (the distributed rank, 0 without one) when they have
    none: a root handler whose format names ``%(rank)s`` (set by a filter on the root logger, which records of
    other loggers never pass) then formats them."""

    def filter(self, record):
        if not hasattr(record, "rank"):
            record.rank = distributed.rank()
        return True


if not any(isinstance(f, RankField) for f in log.filters):
    log.addFilter(RankField())


def maybe_print(message, verbosity, rank0=False):
    """Apex's ``maybe_print``: print when ``verbosity > 0``; with ``rank0`` only on rank 0 of a multi-rank run."""
    if verbosity > 0 and not (rank0 and distributed.world_size() > 1 and distributed.rank() != 0):
        print(message)


def _as_apex(name, value):
    """An override as Apex's ``Properties`` stored it (the strings 'True'/'False', loss_scale as a float)."""
    if name == "keep_batchnorm_fp32" and value in ("True", "False"):
        return value == "True"
    if name == "loss_scale" and value != "dynamic":
        try:
            return float(value)
        except (TypeError, ValueError):
            return value
    return value


def print_initialize(call):
    """Apex's lines for ``amp.initialize(**call)`` (``call``: the keyword arguments as passed)."""
    level, verbosity = call.get("opt_level", "O1"), call.get("verbosity", 1)
    if not call.get("enabled", True) or level not in _BRIEF or not isinstance(verbosity, int):
        return  # Apex printed nothing when disabled; a bad opt level raises
    options = {"enabled": True, "opt_level": level, **dict(zip(_OPTIONS, _DEFAULTS[level]))}

    def show(title):
        maybe_print(title, verbosity, True)
        for name, value in options.items():
            maybe_print(f"{name:22} : {value}", verbosity, True)

    maybe_print(f"Selected optimization level {_BRIEF[level]}", verbosity, True)
    show("Defaults for this optimization level are:")
    options.update((name, _as_apex(name, call[name])) for name in _OPTIONS if call.get(name) is not None)
    maybe_print("Processing user overrides (additional kwargs that are not None)...", verbosity, True)
    show("After processing overrides, optimization options are:")


def _verbosity(session):
    return session.extensions.get("apex", {}).get("calls", {}).get("verbosity", 1)


def amp_state_verbosity():
    """Apex's ``_amp_state.verbosity``: the open session's ``amp.initialize(verbosity=...)``, else 1."""
    session = _state.current()
    return _verbosity(session) if session is not None else 1


def _after_step(optimizer, args, kwargs):
    """A step the session skipped after an overflow: Apex's line (printed by Apex's patched ``step``)."""
    session = _state.current()
    state = session.scaling.opt_states.get(id(optimizer)) if session is not None else None
    if state is None or "apex" not in session.extensions or not state.last_skipped:
        return
    scaler = state.doomed_by if state.doomed_by is not None else session.scaling.scaler(0)
    state.doomed_by = None
    maybe_print(f"Gradient overflow.  Skipping step, loss scaler {scaler.loss_id} reducing loss scale to "
                f"{scaler.scale}", _verbosity(session))


def install(session):
    """Print Apex's overflow line after each skipped step of ``session``'s optimizers (idempotent; the hooks
    go with the session: their removal is on ``session.undo``)."""
    hooked = session.extensions.setdefault("apex_printing", set())  # ids of the optimizers with the hook
    for key, state in session.scaling.opt_states.items():
        if key not in hooked:
            hooked.add(key)
            session.undo.append(state.optimizer.register_step_post_hook(_after_step).remove)
