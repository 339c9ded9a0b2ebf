"""``speed_report(job, ...)``: run the job's steps with light instrumentation and rank what holds them back."""
import dataclasses
import statistics

import torch

from ...errors import ConfigError, UsageError
from ...session import state as _state
from .. import machine
from ..cli import opt_level_hint
from ..experiment.api import make_config
from ..experiment.models import as_job, load_job
from .findings import Context, findings
from .harness import MIN_STEPS, PHASES, Harness, watched_modules
from .report import SpeedReport

OPT_LEVELS = ("O0", "O1", "O2", "O3")


def speed_report(job, *, opt_level="O1", half_dtype=torch.bfloat16, steps=20, device="cpu", seed=0, threads=None):
    """Train ``job`` (a Job, a job dict/object or a ``module:function`` string: the experiment's convention)
    for ``steps`` steps under ``opt_level`` and return a :class:`SpeedReport` of the causes that hold the step
    back, ranked by the step time they cost (see :mod:`amp_patch.tools.speed`). ``threads`` sets
    ``torch.set_num_threads`` for the run (restored after; None keeps torch's): the step time and the findings
    depend on it, and the report's machine line names it."""
    if opt_level not in OPT_LEVELS:
        raise ConfigError(f"opt_level={opt_level!r}; allowed: {', '.join(OPT_LEVELS)}{opt_level_hint(opt_level)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < MIN_STEPS:
        raise ConfigError(f"steps={steps!r}; pass an integer >= {MIN_STEPS} (warm-up, probe, plain and timed "
                          "steps)")
    config = make_config(steps, half_dtype, device, seed, threads)
    if _state.current() is not None:
        raise UsageError("an amp_patch session is active; call amp_patch.deinitialize() before speed_report "
                         "(it initializes the job's model itself)")
    spec = job if isinstance(job, str) else None
    loaded = load_job(job) if spec is not None else as_job(job)
    ctx = Context(job=spec or "MODULE:FUNCTION", opt_level=opt_level, half_dtype=config.half_dtype,
                  device=config.device)
    before = torch.get_num_threads()
    try:
        if config.threads:
            torch.set_num_threads(config.threads)
        m = Harness(loaded, spec or loaded.name, config, opt_level, watched_modules(ctx.half)).run()
        ctx = dataclasses.replace(ctx, machine=machine.describe(config.device, torch.get_num_threads()))

    finally:
        torch.set_num_threads(before)
    step_ms = m.step_ms()
    half_dtype = str(config.half_dtype).removeprefix("torch.")
    return SpeedReport(job=spec or loaded.name, opt_level=opt_level, half_dtype=half_dtype,
                       device=config.device, steps=steps, step_ms=step_ms, machine=ctx.machine,
                       half_hardware=_hardware(ctx, config),
                       findings=findings(m, ctx), phases={p: m.phase_share(p) for p in PHASES},
                       overhead=m.overhead(), overhead_range=[min(m.overhead_units()), max(m.overhead_units())],
                       probe_overhead=statistics.median(m.probe_ms) / step_ms - 1.0)


def _hardware(ctx, config):
    """For a half opt level, whether its dtype runs on hardware here (as the experiment says it), else None."""
    return machine.half_hardware(config.device, config.half_dtype).sentence() if ctx.half else None
