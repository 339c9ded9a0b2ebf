"""Run one variant of a job in this process, in steps: :class:`VariantRun` (``setup``, ``run_round``, ``close``).

Each run seeds torch with the same seed before building the model and the data, so every variant trains the
same initial weights on the same batches. ``setup`` runs the untimed steps: step 0 is a warm-up, step 1 runs
under a cast-counting dispatch mode, step 2 (CUDA only) under CUDA's sync debug mode. Each ``run_round(n)``
then times ``n`` more steps, so that the caller can interleave the rounds of several variants (each in its own
process: :mod:`amp_patch.tools.experiment.isolation`) and one noisy moment of the machine hits every variant alike.

Peak memory is measured per round too, where the peak can be reset for the round: on CUDA (the allocator's
peak), and on CPU in a variant's own process on Linux (the process's peak RSS, reset through
``/proc/self/clear_refs``). An in-process run leaves the caller's process alone: its rounds record None.
``peak_memory_mib`` stays the whole run's peak (setup included).
"""
import contextlib
import copy
import dataclasses
import math
import os
import resource
import statistics
import sys
import time
import traceback

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from .models import as_job, load_job
from .state_bytes import state_mib
from .variants import CastCounter, count_syncs, make_variant

_COUNT_STEP, _SYNC_STEP = 1, 2


@dataclasses.dataclass(frozen=True)
class Config:
    """What every variant of one experiment shares."""

    steps: int = 40
    half_dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    seed: int = 0
    threads: object = None  # torch.set_num_threads for the run; None keeps torch's default
    rounds: int = 5  # the timed steps are split into this many interleaved rounds
    timeout_s: object = 600.0  # per variant (isolated runs only); None: no limit
    op_lists: tuple = ()  # (label, spec) of each op list an ``O1 [label]`` variant runs with

    def untimed_steps(self):
        """Steps ``setup`` runs before the timed rounds (warm-up, cast count, and the sync count on CUDA)."""
        return min(self.steps, _SYNC_STEP + 1 if torch.device(self.device).type == "cuda" else _COUNT_STEP + 1)

    def round_sizes(self):
        """Timed steps per round: the steps after ``untimed_steps()`` split as evenly as possible."""
        timed = self.steps - self.untimed_steps()
        rounds = min(self.rounds, timed)
        return [timed // rounds + (i < timed % rounds) for i in range(rounds)] if rounds > 0 else []


def new_result(variant, isolated):
    return {"variant": variant, "status": "ok", "error": None, "traceback": None, "pid": os.getpid(),
            "isolated": isolated, "threads": None, "steps_run": 0, "losses": [], "loss_scales": [],
            "skipped_steps": 0, "step_times_ms": [], "median_step_ms": None, "casts_per_iteration": None,
            "weight_casts_per_iteration": None, "distinct_weights_cast": None, "syncs_per_step": None,
            "peak_memory_mib": None, "memory_at_start_mib": None, "memory_kind": None, "final_loss": None,
            "final_loss_scale": None, "rounds": [], "step_ms_min": None, "step_ms_max": None,
            "peak_memory_median_mib": None, "peak_memory_min_mib": None, "peak_memory_max_mib": None,
            "state_mib": None}


def mark_interrupted(result, config):
    """Ctrl-C: ``result`` marked ``interrupted`` unless it finished all its rounds (or had failed already)."""
    finished = len(result["rounds"])
    if result["status"] == "ok" and finished < len(config.round_sizes()):
        result.update(status="interrupted", error=f"Ctrl-C after {finished} of {len(config.round_sizes())} round(s)")
    return result


def fail_result(result, exc):
    result["status"] = "failed"
    result["error"] = f"{type(exc).__name__}: {exc}"
    result["traceback"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])


class VariantRun:
    """One variant of one job, trained in this process: ``setup()``, ``run_round(n)`` per round, ``close()``.

    No method raises for a failure of the job or the variant: the result says ``failed`` (or ``diverged``)
    with the error, and later rounds do nothing.
    """

    def __init__(self, job, variant, config, on_step=None, isolated=False):
        self.job, self.config, self.on_step = job, config, on_step
        self.result = new_result(variant, isolated)
        self.device = torch.device(config.device)
        self.runner = None
        self.step = 0
        self.active = False
        self._old_threads = torch.get_num_threads()
        self._peak_before_resets = None  # the run's peak memory read before each round reset it

    def setup(self):
        self.result["memory_at_start_mib"] = _memory_now_mib(self.device)
        with self._guard():
            self.runner = make_variant(self.result["variant"], self.config.half_dtype, self.config.device,
                                       self.config.op_lists)
            if self.config.threads:
                torch.set_num_threads(self.config.threads)
            self.result["threads"] = torch.get_num_threads()
            self._build()
            self.active = True
            hook = self.optimizer.register_step_pre_hook(self._note_state)  # (untimed steps only)
            try:
                self._steps(self.config.untimed_steps(), None)
            finally:
                hook.remove()

    def _note_state(self, optimizer, args, kwargs):
        """As ``step()`` begins (grads in place, optimizer state from the last step): weights + grads +
        optimizer state in MiB, the largest seen."""
        self.result["state_mib"] = max(self.result["state_mib"] or 0.0, state_mib(self.model, optimizer))

    def run_round(self, steps):
        """Time ``steps`` more steps; their times become one entry of ``result["rounds"]``."""
        if not self.active:
            return
        record = {"round": len(self.result["rounds"]), "first_step": self.step, "step_times_ms": [],
                  "median_step_ms": None, "peak_memory_mib": None}
        self.result["rounds"].append(record)
        before = reset_peak_memory(self.device, self.result["isolated"])
        if before is not None:
            self._peak_before_resets = max(before, self._peak_before_resets or 0.0)
        with self._guard():
            self._steps(steps, record["step_times_ms"])
        if record["step_times_ms"]:
            record["median_step_ms"] = statistics.median(record["step_times_ms"])
        if before is not None:
            record["peak_memory_mib"] = _peak_since_reset_mib(self.device)

    def close(self):
        """Undo the variant (deinitialize), restore the thread count; returns the finished result dict."""
        self.active = False
        with self._guard():
            if self.runner is not None:
                self.runner.close()
        torch.set_num_threads(self._old_threads)
        _finish(self.result, self.device, self.result["isolated"])
        _finish_memory(self.result, self._peak_before_resets)
        return self.result

    def snapshot(self):
        """A copy of the result as ``close()`` would finish it now (what an interrupted experiment keeps)."""
        result = copy.deepcopy(self.result)
        _finish(result, self.device, result["isolated"])
        _finish_memory(result, self._peak_before_resets)
        return result

    @contextlib.contextmanager
    def _guard(self):
        try:
            yield
        except Exception as exc:  # the report carries it; the other variants still run
            self.active = False
            if self.result["status"] == "ok":
                fail_result(self.result, exc)

    def _build(self):
        job, config = as_job(self.job), self.config
        torch.manual_seed(config.seed)
        model = job.model_fn().to(self.device)
        optimizer = job.optimizer_fn(model)
        torch.manual_seed(config.seed + 1)
        self.batches = fixed_batches(job, config)
        self.params = list(model.parameters())
        self.model, self.optimizer = self.runner.setup(model, optimizer)
        self.model.train()
        self.job = job

    def _steps(self, count, times):
        for _ in range(count):
            if not self.active:
                return
            batch = [t.to(self.device, non_blocking=True) if torch.is_tensor(t) else t for t in next(self.batches)]
            loss = _measured_step(self.step, self, batch, times)
            self.step += 1
            if not _record(self.step - 1, loss, self.optimizer, self.runner, self.result):
                self.active = False
                self._note_nonfinite_params()
                return
            if self.on_step is not None:
                self.on_step(self.step)

    def _note_nonfinite_params(self):
        bad = sum(not torch.isfinite(p).all() for p in self.model.parameters())
        if bad:
            self.result["error"] += (f"; {bad} parameter tensor(s) were already non-finite (the previous "
                                     "optimizer step produced them)")


def run_variant(job, variant, config, on_step=None, isolated=False):
    """Train ``job`` for ``config.steps`` steps under ``variant`` in one go; returns the result dict."""
    run = VariantRun(job, variant, config, on_step=on_step, isolated=isolated)
    run.setup()
    for size in config.round_sizes():
        run.run_round(size)
    return run.close()


def _memory_now_mib(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2 ** 20
    return _rss_now_mib()


def _measured_step(step, run, batch, times):
    """One training step; counted (casts, syncs) when it is the count or sync step, timed into ``times``."""
    config, args = run.config, (run.model, run.optimizer, run.runner, run.job, batch)
    if step == min(_COUNT_STEP, config.steps - 1):
        counter = CastCounter(run.params)
        with counter:
            loss = _one_step(*args)
        run.result["casts_per_iteration"] = counter.casts
        run.result["weight_casts_per_iteration"] = len(counter.param_casts)
        run.result["distinct_weights_cast"] = len(set(counter.param_casts))
        return loss
    if step == _SYNC_STEP and run.device.type == "cuda":
        with count_syncs(config.device) as syncs:
            loss = _one_step(*args)
        run.result["syncs_per_step"] = len(syncs)
        return loss
    cuda = run.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = _one_step(*args)
    if cuda:
        torch.cuda.synchronize()
    if times is not None:
        elapsed = (time.perf_counter() - start) * 1e3
        times.append(elapsed)
        run.result["step_times_ms"].append(elapsed)
    return loss


def _one_step(model, optimizer, runner, job, batch):
    optimizer.zero_grad(set_to_none=True)
    with runner.forward_context():
        output = model(*batch[:-1])
        loss = job.loss_fn(output, batch[-1])
    runner.backward_and_step(loss, optimizer)
    return loss


def _record(step, loss, optimizer, runner, result):
    """Book-keeping after a step (outside the timed region). False when the loss is not finite."""
    value = float(loss.detach().float())
    result["steps_run"] = step + 1
    result["losses"].append(value if math.isfinite(value) else str(value))
    result["loss_scales"].append(runner.loss_scale())
    result["skipped_steps"] += bool(runner.last_skipped(optimizer))
    if not math.isfinite(value):
        result["status"] = "diverged"
        result["error"] = f"the loss became {value} at step {step}"
        return False
    return True


def fixed_batches(job, config):
    """An endless iterator over the job's batches (a DataLoader, reshuffled each epoch from a seeded generator).
    ``data_fn`` runs now, before the variant's ``setup``: a job's data is made as its script would make it, in
    fp32, not under O1's patches (a lazy call ran the built-in jobs' teacher matmul in half under O1 only, so its
    rows trained on other labels than native's)."""
    data = job.data_fn()
    if isinstance(data, (tuple, list)) and all(torch.is_tensor(t) for t in data):
        data = TensorDataset(*data)
    if isinstance(data, Dataset) and hasattr(data, "__len__"):
        cuda = torch.device(config.device).type == "cuda"
        data = DataLoader(data, batch_size=job.batch_size, shuffle=True, drop_last=len(data) >= job.batch_size,
                          generator=torch.Generator().manual_seed(config.seed), num_workers=2 if cuda else 0,
                          pin_memory=cuda, persistent_workers=cuda)
    return _endless(data)


def _endless(data):
    total = 0
    while True:
        before = total
        for batch in data:
            total += 1
            yield batch
        if total == before:
            raise ValueError(f"the job's data ran out after {total} batches; data_fn should return a Dataset, a "
                             "tuple of tensors or a re-iterable DataLoader (not a one-shot iterator)")


def _finish(result, device, isolated):
    result["final_loss"] = result["losses"][-1] if result["losses"] else None
    result["final_loss_scale"] = result["loss_scales"][-1] if result["loss_scales"] else None
    medians = [r["median_step_ms"] for r in result["rounds"] if r["median_step_ms"] is not None]
    if medians:  # the median over the rounds' medians, and their spread
        result["median_step_ms"] = statistics.median(medians)
        result["step_ms_min"], result["step_ms_max"] = min(medians), max(medians)
    if device.type == "cuda":
        result["peak_memory_mib"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
        result["memory_kind"] = "CUDA max allocated"
    else:
        result["syncs_per_step"] = f"n/a ({device.type.upper()})"
        result["peak_memory_mib"] = _rss_peak_mib()
        result["memory_kind"] = "process RSS peak" + ("" if isolated else " (shared by in-process variants)")


def reset_peak_memory(device, own_process):
    """Start a round's peak-memory window: returns the peak so far (MiB), read before resetting it, or None when
    the peak cannot be reset for the round (CPU in a process that is not the variant's own, or not Linux)."""
    if device.type == "cuda":
        before = torch.cuda.max_memory_allocated(device) / 2 ** 20
        torch.cuda.reset_peak_memory_stats(device)
        return before
    before = _rss_peak_mib()
    if not own_process or _rss_hwm_mib() is None:
        return None
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # Linux: set the process's peak RSS (VmHWM, and so ru_maxrss) to its current RSS
    except OSError:
        return None
    return before


def _peak_since_reset_mib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return _rss_hwm_mib()


def _finish_memory(result, peak_before_resets):
    """The whole run's peak (including what the rounds' resets hid, and the round peaks themselves: read from
    VmHWM, they can be a few pages above getrusage's) and the rounds' median, min and max peak."""
    peaks = [r["peak_memory_mib"] for r in result["rounds"] if r.get("peak_memory_mib") is not None]
    if peak_before_resets is not None and result["peak_memory_mib"] is not None:
        result["peak_memory_mib"] = max(result["peak_memory_mib"], peak_before_resets, *peaks)
    if peaks:
        result["peak_memory_median_mib"] = statistics.median(peaks)
        result["peak_memory_min_mib"], result["peak_memory_max_mib"] = min(peaks), max(peaks)


def _rss_hwm_mib():
    """The process's peak RSS since its last reset (Linux's VmHWM), or None where /proc does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) / 2 ** 10
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _rss_now_mib():
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError, IndexError, AttributeError):
        return None  # not Linux: the report shows the peak only


def _rss_peak_mib():
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2 ** 20 if sys.platform == "darwin" else peak / 2 ** 10  # bytes on macOS, KiB on Linux


def job_from_ref(ref):
    """A job reference as sent to a variant process: a ``module:function`` string or a picklable Job."""
    return load_job(ref) if isinstance(ref, str) else as_job(ref)
