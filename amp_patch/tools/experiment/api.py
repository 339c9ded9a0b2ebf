"""``compare`` (one job, Python API) and ``run_experiment`` (several jobs, what the CLI calls)."""
import dataclasses
import logging
import math
import pickle
import sys

import torch

from ...config.dtypes import parse_half_dtype
from ...errors import ConfigError, ExperimentInterrupted, UsageError
from ...session import state as _state
from .isolation import IsolatedRun, Processes
from .models import Job, as_job, load_job
from .plot import write_png
from .report import Progress, markdown, summarize, write_json
from .runner import Config, VariantRun, job_from_ref, mark_interrupted
from .variants import VARIANTS, expand_op_lists, op_list_pairs, parse_variants
from .verdict import LOSS_TOLERANCE, MIN_ROUNDS

log = logging.getLogger("amp_patch")


def compare(model_fn, optimizer_fn, data_fn, loss_fn, *, variants=VARIANTS, steps=40, half_dtype=torch.bfloat16,
            device="cpu", seed=0, out_dir=None, isolate=True, batch_size=32, name="job", progress=True,
            threads=None, rounds=5, timeout_s=600.0, loss_tolerance=LOSS_TOLERANCE, op_lists=None):
    """Train the same job under each variant (fp32/O0, O1, O2, O3, native autocast) and report.

    Each variant runs in its own spawned process (``isolate=True``; the four callables must then be
    importable module-level functions) or, with ``isolate=False``, one after the other in this process.
    See :mod:`amp_patch.tools.experiment.models` for the callables' signatures. Returns the report dict (what
    the JSON file holds for this job); with ``out_dir`` also writes ``experiment.json`` and, when
    matplotlib is installed, ``experiment.png`` there. ``threads`` sets ``torch.set_num_threads`` for each
    run (e.g. 1 for steadier CPU timings on a busy machine); None keeps torch's default. The timed steps are
    split into ``rounds`` rounds; with ``isolate=True`` each round runs every variant in turn (interleaved),
    and a variant process working longer than ``timeout_s`` seconds in all is killed and reported as
    ``timeout`` (None: no limit). ``loss_tolerance``: the verdict's bound on a variant's loss gap to fp32,
    relative to fp32's loss (:mod:`amp_patch.tools.experiment.verdict`). ``op_lists``: shipped names or YAML
    files; O1 then runs once per list (variants ``O1 [apex]``, ``O1 [fixed.yaml]``). Ctrl-C raises
    :class:`~amp_patch.errors.ExperimentInterrupted`, whose ``reports`` hold the finished rounds (also written
    to ``out_dir``, marked ``partial``).
    """
    job = as_job(Job(model_fn, optimizer_fn, data_fn, loss_fn, batch_size=batch_size, name=name))
    return run_experiment([job], variants=variants, steps=steps, half_dtype=half_dtype, device=device, seed=seed,
                          out_dir=out_dir, isolate=isolate, progress=progress, threads=threads, rounds=rounds,
                          timeout_s=timeout_s, loss_tolerance=loss_tolerance, op_lists=op_lists)[0]


def run_experiment(jobs, *, variants=VARIANTS, steps=40, half_dtype=torch.bfloat16, device="cpu", seed=0,
                   out_dir=None, isolate=True, progress=True, threads=None, rounds=5, timeout_s=600.0,
                   loss_tolerance=LOSS_TOLERANCE, op_lists=None):
    """Run every job (a :class:`Job` or a ``module:function`` string) under every variant; a list of reports.
    ``op_lists`` (shipped names or YAML files; else each job's own ``Job.op_lists``): O1 runs once per list, as
    the variants ``O1 [name]``. The other keywords are :func:`compare`'s."""
    config = make_config(steps, half_dtype, device, seed, threads, rounds, timeout_s)
    variants = with_reference(parse_variants(variants))
    _check_tolerance(loss_tolerance)
    shared = op_list_pairs(op_lists)
    expand_op_lists(variants, shared)  # refuses op lists without O1 before any job loads
    refs = [_check_ref(ref, isolate) for ref in jobs]
    if not isolate and _state.current() is not None:
        raise UsageError("an amp_patch session is active; call amp_patch.deinitialize() before running an "
                         "in-process experiment (or pass isolate=True)")
    plans = [_plan(ref, variants, config, shared if op_lists is not None else None) for ref in refs]
    plans = [(ref, title, *rest) for (ref, _, *rest), title in zip(plans, job_titles(refs, [p[1] for p in plans]))]
    bar = Progress(sum(len(p[2]) for p in plans), config.steps, enabled=progress)
    bar.announce(_starting_line(refs, [p[2] for p in plans], config, isolate))
    reports = []
    processes = Processes() if isolate else None  # one per variant, reused from job to job
    try:
        for ref, name, job_variants, job_config in plans:
            reports.append(_run_job(ref, job_variants, job_config, isolate, bar, loss_tolerance, name, processes))
    except KeyboardInterrupt as stop:  # (ExperimentInterrupted from _run_job: its report so far)
        reports += getattr(stop, "reports", [])
        _write(reports, out_dir, partial=len(reports) < len(refs))
        raise ExperimentInterrupted(reports) from None
    finally:
        if processes is not None:
            processes.close()
        bar.close()
    _write(reports, out_dir, partial=False)
    return reports


def _plan(ref, variants, config, shared):
    """``(ref, job name, variants, config)`` of one job: O1 expanded into its op lists (the experiment's, or the
    job's own ``Job.op_lists``), whose specs travel in the config."""
    job = ref if isinstance(ref, Job) else load_job(ref)  # the job's own name and op lists, if it gives them
    pairs = shared if shared is not None else op_list_pairs(job.op_lists or None)
    return ref, job.name, expand_op_lists(variants, pairs), dataclasses.replace(config, op_lists=pairs)


def job_titles(refs, names):
    """Each job's report title, one per job, never two alike (the JSON's ``jobs`` is keyed by them): its name,
    and where two jobs share a name, each of them with its ``module:function`` spec (a Job object: its place in
    the list, ``#2``), and its place too when even that repeats (the same spec twice)."""
    def where(i, ref):
        return ref if isinstance(ref, str) else f"#{i}"

    titles = [name if names.count(name) == 1 else f"{name} ({where(i, ref)})"
              for i, (ref, name) in enumerate(zip(refs, names), 1)]
    return [title if titles.count(title) == 1 else f"{names[i - 1]} ({where(i, ref)}, #{i})"
            for i, (ref, title) in enumerate(zip(refs, titles), 1)]


def _write(reports, out_dir, partial):
    if out_dir is not None:
        write_json(reports, out_dir, partial=partial)
        write_png(reports, out_dir)


def with_reference(variants):
    """``variants`` with fp32 (O0) first when it is missing: every ratio and loss gap is taken against it."""
    if "fp32" in variants:
        return variants
    log.info("experiment: fp32 (O0) added to the variants: it is the reference of every ratio and loss gap")
    return ("fp32",) + tuple(variants)


def _starting_line(refs, planned, config, isolate):
    """``planned``: each job's variants as they run (O1 expanded into one row per op list)."""
    where = "in separate processes" if isolate else "in this process"
    counts = sorted({len(v) for v in planned})
    jobs = f" x {len(refs)} jobs" if len(refs) > 1 else ""
    count = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    plural = "s" if counts != [1] else ""
    return (f"starting {count} variant{plural}{jobs} {where} "
            f"({config.steps} steps, {str(config.half_dtype).replace('torch.', '')}, {config.device}"
            f"{_fewer_rounds(config)})...")


def _fewer_rounds(config):
    """Says so when the timed steps are too few for the rounds asked for (a quick check)."""
    sizes = config.round_sizes()
    if len(sizes) >= config.rounds:
        return ""
    timed = sum(sizes)
    return (f"; {timed} timed step{'s' if timed != 1 else ''}, so {len(sizes)} round{'s' if len(sizes) != 1 else ''}"
            f" instead of {config.rounds}" + (f" (a significant verdict needs {MIN_ROUNDS})"
                                              if len(sizes) < MIN_ROUNDS else ""))


def _check_tolerance(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ConfigError(f"loss_tolerance={value!r}; pass a number >= 0 (0.05: a loss within 5% of fp32's)")
    if value > 1:
        raise ConfigError(f"loss_tolerance={value!r} is a fraction of fp32's loss: {value!r} accepts a loss "
                          f"{value:.0%} off fp32's. Pass at most 1; for {value:g}%, pass {value / 100:g} "
                          "(0.05: a loss within 5% of fp32's)")


def make_config(steps, half_dtype, device, seed, threads=None, rounds=5, timeout_s=600.0):
    _check_positive("steps", steps)
    _check_positive("rounds", rounds)
    if threads is not None:
        _check_positive("threads", threads)
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not timeout_s > 0):
        raise ConfigError(f"timeout_s={timeout_s!r}; pass a positive number of seconds, or None for no limit")
    half_dtype = parse_half_dtype(half_dtype)
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r}; allowed: 'cpu', 'cuda' ({exc})") from None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r}; allowed: 'cpu', 'cuda'")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}, but torch.cuda.is_available() is False on this machine "
                          f"(torch {torch.__version__}); use device='cpu'")
    config = Config(steps=steps, half_dtype=half_dtype, device=str(device), seed=int(seed), threads=threads,
                    rounds=rounds, timeout_s=None if timeout_s is None else float(timeout_s))
    _check_timed(config)
    return config


def _check_timed(config):
    """Refuse a run that would time no step: the first steps are untimed (warm-up, cast count, CUDA syncs)."""
    untimed = dataclasses.replace(config, steps=sys.maxsize).untimed_steps()
    if config.steps > untimed:
        return
    what = "warm-up, cast count" + (", sync count" if untimed > 2 else "")
    raise ConfigError(f"steps={config.steps}: no step would be timed, the first {untimed} steps are untimed "
                      f"({what}) on {config.device}; pass steps >= {untimed + 1} (>= {untimed + MIN_ROUNDS} for "
                      f"a verdict that can be significant; the default is 40)")


def _check_positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}; pass a positive integer")


def _check_ref(ref, isolate):
    if isinstance(ref, str):
        return ref
    job = as_job(ref)
    if isolate:
        _check_not_interactive_main(job)
        try:
            pickle.dumps(job)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise ConfigError(f"job {job.name!r} cannot be sent to a variant process ({exc}); with isolate=True "
                              "model_fn, optimizer_fn, data_fn and loss_fn must be importable module-level "
                              "functions (no lambdas or closures). Pass isolate=False to run in-process.") from None
    return job


def _check_not_interactive_main(job):
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None):
        return  # a script: spawned processes re-import it
    for field in ("model_fn", "optimizer_fn", "data_fn", "loss_fn"):
        if getattr(getattr(job, field), "__module__", None) == "__main__":
            raise ConfigError(f"{field} is defined in an interactive session or 'python -c', which a spawned "
                              "variant process cannot import; put the job in a module (or a script file), "
                              "or pass isolate=False")


def _run_job(ref, variants, config, isolate, bar, loss_tolerance=LOSS_TOLERANCE, name="job", processes=None):
    """Every variant of one job: set up, then the timed rounds (interleaved when isolated), then close."""

    def on_step(label):
        return lambda done: bar.step(done, label)

    if isolate:
        runs = {v: IsolatedRun(ref, v, config, on_step=on_step(f"{name} {v}"),
                               process=processes.get(v) if processes is not None else None) for v in variants}
        order = [list(runs.items())]  # one schedule for all: round i of every variant, then round i + 1
    else:  # one amp_patch session at a time in this process: each variant's rounds back to back
        runs = {v: VariantRun(job_from_ref(ref), v, config, on_step=on_step(f"{name} {v}")) for v in variants}
        order = [[item] for item in runs.items()]
    results = {}
    try:
        for group in order:
            results.update(_run_group(group, name, config, bar))
    except KeyboardInterrupt:  # Ctrl-C: end every variant, keep their finished rounds
        results.update({v: results.get(v) or _interrupted(run, config) for v, run in runs.items()})
        report = summarize(name, config, {v: results[v] for v in variants}, isolate, loss_tolerance)
        report["partial"] = any(r["status"] == "interrupted" for r in results.values())
        raise ExperimentInterrupted([report]) from None
    return summarize(name, config, {v: results[v] for v in variants}, isolate, loss_tolerance)


def _interrupted(run, config):
    """The run's result so far, marked interrupted if it had rounds left (an in-process run is closed: its
    session undone)."""
    if isinstance(run, IsolatedRun):
        return run.interrupt()
    return mark_interrupted(run.close() if run.active or run.runner is not None else run.result, config)


def _run_group(group, name, config, bar):
    for variant, run in group:
        bar.start(f"{name} {variant}")
        run.setup()
    sizes = config.round_sizes()
    for number, size in enumerate(sizes, 1):
        for variant, run in group:
            bar.start(f"{name} {variant}")
            run.run_round(size)
        bar.note(f"{name} {'/'.join(v for v, _ in group)}: round {number}/{len(sizes)}")
    results = {}
    for variant, run in group:
        result = results[variant] = run.close()
        bar.end_run(result["status"], f"{name} {variant}")
        if result["status"] != "ok":
            log.info("experiment: %s %s %s: %s", name, variant, result["status"], result["error"])
    return results


def format_reports(reports):
    """The markdown the CLI prints: one section per job."""
    return "\n\n".join(markdown(r) for r in reports)
