"""Run one variant of a job: in this process (``run_variant``) or in a fresh spawned one (``run_isolated``).

Each run seeds torch with the same seed before building the model and the data, so every variant trains the
same initial weights on the same batches. Step 0 is a warm-up, step 1 runs under a cast-counting dispatch
mode, step 2 (CUDA only) under CUDA's sync debug mode; the remaining steps are timed.
"""
import dataclasses
import math
import multiprocessing
import os
import resource
import statistics
import sys
import time
import traceback

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from .models import as_job, load_job
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


def new_result(variant, isolated):
    return {"variant": variant, "status": "ok", "error": None, "traceback": None, "pid": os.getpid(),
            "isolated": isolated, "threads": None, "steps_run": 0, "losses": [], "loss_scales": [],
            "skipped_steps": 0, "step_times_ms": [], "median_step_ms": None, "casts_per_iteration": None,
            "weight_casts_per_iteration": None, "distinct_weights_cast": None, "syncs_per_step": None,
            "peak_memory_mib": None, "memory_at_start_mib": None, "memory_kind": None, "final_loss": None,
            "final_loss_scale": None}


def _fail(result, exc):
    result["status"] = "failed"
    result["error"] = f"{type(exc).__name__}: {exc}"
    result["traceback"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])


def run_variant(job, variant, config, on_step=None, isolated=False):
    """Train ``job`` for ``config.steps`` steps under ``variant``; returns the result dict (never raises
    for a failure of the job or the variant: the result says ``failed`` with the error)."""
    result = new_result(variant, isolated)
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        result["memory_at_start_mib"] = torch.cuda.memory_allocated(device) / 2 ** 20
    else:
        result["memory_at_start_mib"] = _rss_now_mib()
    runner = make_variant(variant, config.half_dtype, config.device)
    old_threads = torch.get_num_threads()
    try:
        if config.threads:
            torch.set_num_threads(config.threads)
        result["threads"] = torch.get_num_threads()
        _train(as_job(job), runner, config, result, on_step)
    except Exception as exc:  # the report carries it; the other variants still run
        _fail(result, exc)
    finally:
        runner.close()
        torch.set_num_threads(old_threads)
    _finish(result, device, isolated)
    return result


def _train(job, runner, config, result, on_step):
    device = torch.device(config.device)
    torch.manual_seed(config.seed)
    model = job.model_fn().to(device)
    optimizer = job.optimizer_fn(model)
    torch.manual_seed(config.seed + 1)
    batches = _batches(job, config)
    params = list(model.parameters())
    model, optimizer = runner.setup(model, optimizer)
    model.train()
    for step in range(config.steps):
        batch = [t.to(device, non_blocking=True) if torch.is_tensor(t) else t for t in next(batches)]
        loss = _measured_step(step, model, optimizer, runner, job, batch, params, config, result)
        if not _record(step, loss, optimizer, runner, result):
            bad = sum(not torch.isfinite(p).all() for p in model.parameters())
            if bad:
                result["error"] += (f"; {bad} parameter tensor(s) were already non-finite (the previous "
                                    "optimizer step produced them)")
            return
        if on_step is not None:
            on_step(step + 1)


def _measured_step(step, model, optimizer, runner, job, batch, params, config, result):
    if step == min(_COUNT_STEP, config.steps - 1):
        counter = CastCounter(params)
        with counter:
            loss = _one_step(model, optimizer, runner, job, batch)
        result["casts_per_iteration"] = counter.casts
        result["weight_casts_per_iteration"] = len(counter.param_casts)
        result["distinct_weights_cast"] = len(set(counter.param_casts))
        return loss
    if step == _SYNC_STEP and torch.device(config.device).type == "cuda":
        with count_syncs(config.device) as syncs:
            loss = _one_step(model, optimizer, runner, job, batch)
        result["syncs_per_step"] = len(syncs)
        return loss
    cuda = torch.device(config.device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = _one_step(model, optimizer, runner, job, batch)
    if cuda:
        torch.cuda.synchronize()
    if step > 0:
        result["step_times_ms"].append((time.perf_counter() - start) * 1e3)
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


def _batches(job, config):
    """An endless iterator over the job's batches (a DataLoader, reshuffled each epoch from a seeded generator)."""
    data = job.data_fn()
    if isinstance(data, (tuple, list)) and all(torch.is_tensor(t) for t in data):
        data = TensorDataset(*data)
    if isinstance(data, Dataset) and hasattr(data, "__len__"):
        cuda = torch.device(config.device).type == "cuda"
        data = DataLoader(data, batch_size=job.batch_size, shuffle=True, drop_last=len(data) >= job.batch_size,
                          generator=torch.Generator().manual_seed(config.seed), num_workers=2 if cuda else 0,
                          pin_memory=cuda, persistent_workers=cuda)
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
    if result["step_times_ms"]:
        result["median_step_ms"] = statistics.median(result["step_times_ms"])
    if device.type == "cuda":
        result["peak_memory_mib"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
        result["memory_kind"] = "CUDA max allocated"
    else:
        result["syncs_per_step"] = f"n/a ({device.type.upper()})"
        result["peak_memory_mib"] = _rss_peak_mib()
        result["memory_kind"] = "process RSS peak" + ("" if isolated else " (shared by in-process variants)")


def _rss_now_mib():
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError, IndexError, AttributeError):
        return None  # not Linux: the report shows the peak only


def _rss_peak_mib():
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2 ** 20 if sys.platform == "darwin" else peak / 2 ** 10  # bytes on macOS, KiB on Linux


# --- isolation -------------------------------------------------------------------------------------------

def job_from_ref(ref):
    """A job reference as sent to a variant process: a ``module:function`` string or a picklable Job."""
    return load_job(ref) if isinstance(ref, str) else as_job(ref)


def _child_main(conn, job_ref, variant, config):
    try:
        job = job_from_ref(job_ref)
    except Exception as exc:
        result = new_result(variant, True)
        _fail(result, exc)
    else:
        result = run_variant(job, variant, config, on_step=lambda s: conn.send(("step", s)), isolated=True)
    conn.send(("result", result))
    conn.close()


def run_isolated(job_ref, variant, config, on_step=None):
    """Run the variant in a fresh spawned process; a crash of that process is reported as a failure."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(sender, job_ref, variant, config), daemon=True)
    proc.start()
    sender.close()
    result = None
    try:
        while True:
            try:
                kind, payload = receiver.recv()
            except EOFError:
                break
            if kind == "result":
                result = payload
            elif on_step is not None:
                on_step(payload)
    finally:
        receiver.close()
        proc.join()
    if result is None:
        result = new_result(variant, True)
        result.update(status="failed", pid=proc.pid,
                      error=f"the variant's process exited with code {proc.exitcode} before reporting a result")
    return result
