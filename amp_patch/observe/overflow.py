"""Overflow origin and the scale/skip history.

``initialize(..., diagnose_overflow=True)`` adds forward hooks (only in this
mode) that record, without a host sync, whether each module's output held
inf/NaN or values beyond the half dtype's range; only when a step overflows are
the flags read, to name the first offending module in execution order and the
parameters with non-finite gradients. The history is a bounded ring buffer of
per-step records that also watches for a collapsing loss scale.
"""
import collections
import contextlib
import logging
import time

import torch

from .._torch.hooks import SessionHook, forward_hooks, forward_pre_hook
from ..casting.wrappers import iter_tensors

log = logging.getLogger("amp_patch")

_COLLAPSE_HINT = ("a loss scale stuck at its floor usually means a genuine inf/NaN in the forward pass, not fp16 "
                  "range: a log/div of zero, a sqrt of a negative, unnormalised inputs or targets, or too high a "
                  "learning rate. Try initialize(..., diagnose_overflow=True) and amp_patch.last_overflow() to find "
                  "the module, check the data, lower the LR, or keep the offending op in float (an op-list edit).")


class OverflowDiagnoser:
    """Forward hooks flagging bad module outputs; turns flags + grads into an overflow record.

    Every overflow is recorded; its WARNING line is rate-limited like the scaler's own message: at most one per
    ``log_interval`` seconds, the next one saying how many were not logged in between."""

    log_interval = 10.0
    clock = staticmethod(time.monotonic)

    def __init__(self, models, half_dtype, tracer=None, quiet=contextlib.nullcontext, max_flags=100_000):
        self.limit = torch.finfo(half_dtype).max
        self.quiet = quiet or contextlib.nullcontext  # O1 casting off: the checks are ours, not the model's ops
        self.flags = collections.deque(maxlen=max_flags)
        self.tracer = tracer  # its last_entry names the patched op that ran last (None without O1)
        self.models = models
        self.inputs = collections.deque(maxlen=max_flags)  # per model call: inf/NaN in its inputs (the data)
        self.handles = forward_hooks([(module, _FlagOutputs(self, name or type(model).__name__))
                                      for model in models for name, module in model.named_modules()])
        self.handles += [forward_pre_hook(model, _FlagInputs(self), with_kwargs=True) for model in models]
        self._last_log_time = None
        self._suppressed = 0

    def _input_hook(self, module, args, kwargs):
        tensors = [t for t in iter_tensors((args, kwargs)) if t.is_floating_point() and t.numel()]
        if tensors:
            entry = self.tracer.last_entry if self.tracer is not None else None
            with torch.no_grad(), self.quiet():
                self.inputs.append(torch.stack([torch.isfinite(t).logical_not().any() for t in tensors]).any())
            if self.tracer is not None:
                self.tracer.last_entry = entry
        return None

    def _flag_outputs(self, name, out):
        tensors = [t for t in iter_tensors(out) if t.is_floating_point() and t.numel()]
        if not tensors:
            return
        entry = self.tracer.last_entry if self.tracer is not None else None
        with torch.no_grad(), self.quiet():
            bad = None
            for t in tensors:  # (no sync: the flag stays a tensor until an overflow asks for it)
                flag = torch.logical_or(torch.isfinite(t).logical_not().any(), t.abs().amax().gt(self.limit))
                bad = flag if bad is None else torch.logical_or(bad, flag)
        if self.tracer is not None:
            self.tracer.last_entry = entry  # our own checks must not count as the module's last op
        self.flags.append((name, bad, entry.category if entry else None, entry.qualname if entry else None))

    def first_bad_module(self):
        for name, flag, category, qualname in self.flags:
            if bool(flag):
                return {"module": name, "op": qualname, "category": category}
        return None

    def bad_grads(self, masters):
        return bad_grads(self.models, masters)

    def record(self, loss_id, scale, masters):
        record = {"loss_id": loss_id, "loss_scale": scale, "first_bad_module": self.first_bad_module(),
                  "input_nonfinite": any(bool(flag) for flag in self.inputs), "params": self.bad_grads(masters)}
        self.reset()
        self._log(record)
        return record

    def _log(self, record):
        now = self.clock()
        if self._last_log_time is not None and now - self._last_log_time < self.log_interval:
            self._suppressed += 1
            return
        origin = record["first_bad_module"]
        more = (f" ({self._suppressed} similar message(s) suppressed in the last {now - self._last_log_time:.1f} s; "
                "amp_patch.history() keeps every record)" if self._suppressed else "")
        log.warning("overflow (loss %d, scale %s): first non-finite/out-of-range module output: %s; "
                    "params with non-finite grads: %s%s", record["loss_id"], record["loss_scale"],
                    f"{origin['module']} (last op {origin['op']}, {origin['category']})" if origin else "none found",
                    ", ".join(f"{r['param']} ({r['nonfinite']})" for r in record["params"][:8]) or "none", more)
        self._last_log_time, self._suppressed = now, 0

    def reset(self):
        self.flags.clear()
        self.inputs.clear()

    def remove(self):
        while self.handles:
            self.handles.pop().remove()


class _FlagOutputs(SessionHook):
    """Forward hook of one module: flags inf/NaN or out-of-range outputs (a picklable, session-bound object)."""

    def __init__(self, diagnoser, name):
        self.diagnoser, self.name = diagnoser, name

    def __call__(self, module, args, out):
        self.diagnoser._flag_outputs(self.name, out)


class _FlagInputs(SessionHook):
    """Forward pre-hook of a model: flags inf/NaN in its inputs (the data)."""

    def __init__(self, diagnoser):
        self.diagnoser = diagnoser

    def __call__(self, module, args, kwargs):
        return self.diagnoser._input_hook(module, args, kwargs)


def bad_grads(models, masters):
    """Rows naming the parameters of ``models`` whose gradient (the master's under O2) holds inf/NaN, each param
    once (a tied/shared param lists its other names under "tied")."""
    names = {}
    for model in models:
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), (param, []))[1].append(name)
    rows = []
    for pid, (param, param_names) in names.items():
        grad = masters[pid].grad if pid in masters else None
        grad = grad if grad is not None else param.grad
        if grad is None:
            continue
        grad = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor (FSDP2): this rank's shard
        if grad.layout is not torch.strided:  # a sparse grad (nn.Embedding(sparse=True)): its values as the
            grad = grad.coalesce()._values() if grad.is_sparse else grad.values()  # optimizer sums them
        finite = torch.isfinite(grad)
        bad = int((~finite).sum())
        if bad:
            any_finite = bool(finite.any())
            row = {"param": param_names[0], "nonfinite": bad,  # (no boolean indexing: DTensor/fake-friendly)
                   "max_finite": float(torch.where(finite, grad.abs(), 0).max()) if any_finite else None}
            if len(param_names) > 1:
                row["tied"] = param_names[1:]
            rows.append(row)
    return rows


def skip_cause(losses, overflow, warming_up, scale, grads):
    """Why a step was skipped: ``(kind, text)``, kind one of loss, forward, warmup, grads (first that applies).
    ``losses``: the losses whose grads the step would have taken (a delayed exit's too).

    A non-finite loss is ``forward`` when the diagnoser found the module whose output went bad first and the
    model's inputs were finite, else ``loss`` (inf/NaN in the data says so). ``grads`` is a callable returning
    :func:`bad_grads` rows (only called when nothing earlier explains it).
    """
    bad_loss = any(not bool(torch.isfinite(loss.detach()).all()) for loss in losses)
    origin = overflow and overflow.get("first_bad_module")
    bad_input = bool(overflow and overflow.get("input_nonfinite"))
    if bad_loss and (bad_input or not origin):
        return "loss", ("non-finite loss (inf/NaN in the forward pass, not a loss-scale problem)"
                        + ("; the model's input holds inf/NaN: check the data" if bad_input else ""))
    if origin:
        return "forward", (f"forward overflow at module {origin['module']} (last op {origin['op']}, "
                           f"{origin['category']})" + ("; the loss is non-finite" if bad_loss else ""))
    if warming_up:
        return "warmup", (f"scaler warm-up: loss scale {scale} was too high for the gradients (no step has "
                          "succeeded yet; the dynamic scaler backs off)")
    rows = overflow["params"] if overflow else grads()
    names = ", ".join(r["param"] for r in rows[:8]) + (", ..." if len(rows) > 8 else "")
    return "grads", f"non-finite gradients in params {names}" if rows else "non-finite gradients"


def _within(step, ranges):
    return any(first <= step < end for first, end in ranges)


_RECORD_KEYS = ("step", "loss_id", "scale_before", "scale_after", "skipped", "overflow", "cause_kind", "cause")


class StepHistory:
    """Per-update records in a ring buffer, plus a once-per-scaler warning when a scale collapses. A record's ``step``
    is its scaler's update count (0-based, a loaded scaler's included); an update a ``zero_grad()`` rolled back
    (its step never completed) leaves the history as it leaves the scaler."""

    def __init__(self, size=1000, collapse_steps=20):
        self.records = collections.deque(maxlen=size)
        self.collapse_steps = collapse_steps
        self._at_floor = collections.Counter()
        self._warned = set()

    @staticmethod
    def warming_up(loss_id, scaler):
        """True while a dynamic scaler has not completed a step (its counts, which a loaded state sets too) and can
        still back off (above its ``min_loss_scale`` and 1.0): its skips are warm-up."""
        if not scaler.dynamic or scaler.steps != scaler.skipped_steps:
            return False
        return scaler.scale > max(1.0, scaler.hyperparameters.get("min_loss_scale") or 0.0)

    def add(self, loss_id, before, after, skipped, overflow, scaler, cause=(None, None)):
        if scaler.undone:  # updates of this loss a zero_grad() rolled back since: their records go
            self._drop(loss_id, scaler.undone)
            scaler.undone = []
        self.records.append((scaler.steps - 1, loss_id, before, after, skipped, overflow, cause[0], cause[1]))
        if scaler._dynamic and loss_id not in self._warned:  # (LossScaler.dynamic, without the property's call)
            self._watch(loss_id, after, scaler)

    def _drop(self, loss_id, undone):
        kept = [r for r in self.records if r[1] != loss_id or not _within(r[0], undone)]
        self.records.clear()
        self.records.extend(kept)

    def rows(self, undone=None):
        """The records as dicts (kept as tuples: one is added on every step), oldest first. ``undone``: loss id ->
        its scaler's ``undone`` ranges: the records of updates rolled back since the last record are left out."""
        return [dict(zip(_RECORD_KEYS, record)) for record in self.records
                if not (undone and _within(record[0], undone.get(record[1], ())))]

    def _watch(self, loss_id, scale, scaler):
        floor = scaler.hyperparameters.get("min_loss_scale")
        at_floor = floor is not None and scale <= floor
        self._at_floor[loss_id] = self._at_floor[loss_id] + 1 if at_floor else 0
        if self._at_floor[loss_id] >= self.collapse_steps or (floor is None and scale < 1.0):
            self._warned.add(loss_id)
            log.warning("loss scale of loss %d collapsed to %s. %s", loss_id, scale, _COLLAPSE_HINT)
