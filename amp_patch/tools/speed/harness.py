"""Run a job's training steps under one opt level, in three kinds of step, interleaved:

- *plain* steps time the whole step only (data wait included): their median is the report's step time;
- *timed* steps also time the phases (waiting for the batch, forward with the loss, backward, optimizer step):
  the phase shares come from them, and their median against the plain steps' is the instrumentation's overhead;
- *probe* steps run the probes of :mod:`.probes`, in turn host reads with casts (a dispatch mode, which slows
  every op) and module forward times (hooks on a few modules only); their times are not used as step times, and
  only the probes' own figures are.

On CUDA every phase boundary of a timed step synchronizes (untested: the machine this was written on has no GPU).
"""
import dataclasses
import statistics
import time

import torch
from torch import nn

import amp_patch

from ..experiment.models import call_job
from ..experiment.runner import fixed_batches
from .probes import CastTimer, HostReads, ModuleTimer
from .shapes import misaligned

PHASES = ("data", "forward", "backward", "optimizer")
WARMUP_STEPS, PROBE_STEPS = 2, 4  # probe steps: host reads and casts, then module times, in turn
MIN_STEPS = WARMUP_STEPS + PROBE_STEPS + 2  # and one plain and one timed step


@dataclasses.dataclass
class Measurements:
    """Everything one run measured; :mod:`.findings` turns it into findings."""

    plain_ms: list = dataclasses.field(default_factory=list)
    timed_ms: list = dataclasses.field(default_factory=list)
    phase_ms: dict = dataclasses.field(default_factory=lambda: {p: [] for p in PHASES})
    probe_ms: list = dataclasses.field(default_factory=list)
    host_reads: dict = dataclasses.field(default_factory=dict)  # (file:line, what) -> calls over the probe steps
    host_read_s: list = dataclasses.field(default_factory=list)  # per probe step: seconds in host reads
    cuda_syncs: int = None
    casts: int = 0
    weight_casts: int = 0
    cast_s: list = dataclasses.field(default_factory=list)  # per probe step: seconds in dtype casts
    module_s: dict = dataclasses.field(default_factory=dict)  # module name -> [forward seconds per probe step]
    matmul_s: dict = dataclasses.field(default_factory=dict)  # (file:line, k, n) -> seconds over the probe steps
    probe_steps: int = 0
    model: object = None  # the job's model as the steps ran it (after initialize), for its shapes
    optimizer: object = None
    loader: object = None  # the DataLoader the steps drew from (the job's own, or the experiment's)
    data: object = None  # what data_fn returned

    def step_ms(self):
        return statistics.median(self.plain_ms)

    def phase_ms_median(self, phase):
        return statistics.median(self.phase_ms[phase])

    def phase_share(self, phase):
        """The phase's median over the timed steps' median (medians: a step the machine preempted counts once)."""
        total = statistics.median(self.timed_ms)
        return self.phase_ms_median(phase) / total if total else 0.0

    @staticmethod
    def per_step_ms(seconds):
        """A probe figure per step: the least over the probe steps (the machine's noise only adds time)."""
        return min(seconds, default=0.0) * 1e3

    def share(self, seconds):
        """A probe figure's part of the step time (the plain steps' median)."""
        return self.per_step_ms(seconds) / self.step_ms()

    def overhead_units(self):
        """Per unit of the schedule (plain, timed, timed, plain): the timed steps' time over the plain steps',
        minus 1 (the phase timers' cost, with the machine's noise: a unit shares its state)."""
        count = min(len(self.plain_ms), len(self.timed_ms))
        return [sum(self.timed_ms[i:i + 2]) / sum(self.plain_ms[i:i + 2]) - 1.0 for i in range(0, count, 2)]

    def overhead(self):
        """The phase timers' cost: the median over the units."""
        return statistics.median(self.overhead_units())


def schedule(steps):
    """The kind of each step: warm-up, then plain and timed steps in units of plain, timed, timed, plain (on this
    machine the first step of two runs some 10% slower than the second: each unit has each kind first once), the
    probe steps spread among them."""
    rest = ["plain" if i % 4 in (0, 3) else "timed" for i in range(steps - WARMUP_STEPS - PROBE_STEPS)]
    for k in range(PROBE_STEPS, 0, -1):
        rest.insert(len(rest) * k // (PROBE_STEPS + 1), "probe" if k % 2 else "module_probe")
    return ["warmup"] * WARMUP_STEPS + rest


class Harness:
    """One job under one opt level in this process: ``run()`` returns the :class:`Measurements`."""

    def __init__(self, job, spec, config, opt_level, watched):
        self.job, self.spec, self.config, self.opt_level = job, spec, config, opt_level
        self.watched = watched  # callable(model) -> {name: module} timed on probe steps
        self.device = torch.device(config.device)
        self.cuda = self.device.type == "cuda"
        self.m = Measurements()

    def run(self):
        try:
            self._build()
            for kind in schedule(self.config.steps):
                getattr(self, f"_{kind}")()
        finally:
            amp_patch.deinitialize()
        return self.m

    def _build(self):
        job, config = self.job, self.config
        torch.manual_seed(config.seed)
        model = call_job(self.spec, job.model_fn).to(self.device)
        optimizer = call_job(self.spec, job.optimizer_fn, model)
        torch.manual_seed(config.seed + 1)
        data = self.m.data = call_job(self.spec, job.data_fn)
        self.batches = fixed_batches(dataclasses.replace(job, data_fn=lambda: data), config)
        self.model, self.optimizer = _initialize(model, optimizer, self.opt_level, config.half_dtype)
        self.m.model, self.m.optimizer = self.model, self.optimizer
        self.modules = self.watched(self.model)
        self.model.train()

    def _sync(self):
        if self.cuda:  # untested: no CUDA on the machine this was written on
            torch.cuda.synchronize(self.device)

    def _batch(self):
        batch = next(self.batches)
        if self.m.loader is None:  # the loader fixed_batches iterates: the job's own DataLoader, or the one it built
            self.m.loader = self.batches.gi_frame.f_locals.get("data") if self.batches.gi_frame else None
        return [t.to(self.device, non_blocking=True) if torch.is_tensor(t) else t for t in batch]

    def _forward(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        return self.job.loss_fn(self.model(*batch[:-1]), batch[-1])

    def _backward(self, loss):
        with amp_patch.scale_loss(loss, self.optimizer) as scaled:
            scaled.backward()

    def _whole_step(self):
        self._backward(self._forward(self._batch()))
        self.optimizer.step()

    def _warmup(self):
        self._whole_step()

    def _plain(self):
        self._sync()
        start = time.perf_counter()
        self._whole_step()
        self._sync()
        self.m.plain_ms.append((time.perf_counter() - start) * 1e3)

    def _timed(self):
        self._sync()
        marks = [time.perf_counter()]
        batch = self._batch()
        for work in (self._forward, self._backward, lambda _: self.optimizer.step()):
            self._sync()
            marks.append(time.perf_counter())
            batch = work(batch)
        self._sync()
        marks.append(time.perf_counter())
        for phase, begin, end in zip(PHASES, marks, marks[1:]):
            self.m.phase_ms[phase].append((end - begin) * 1e3)
        self.m.timed_ms.append((marks[-1] - marks[0]) * 1e3)

    def _probe(self):
        start = time.perf_counter()
        batch = self._batch()
        reads = HostReads(self.config.device)
        casts = CastTimer(list(self.model.parameters()), cuda=self.cuda)
        with reads:
            with casts:
                loss = self._forward(batch)
                self._backward(loss)
            self.optimizer.step()
        self.m.probe_ms.append((time.perf_counter() - start) * 1e3)
        self._add(reads, casts)

    def _module_probe(self):
        start = time.perf_counter()
        with ModuleTimer(self.modules, cuda=self.cuda) as timer:
            self._whole_step()
        self.m.probe_ms.append((time.perf_counter() - start) * 1e3)
        for name, seconds in timer.seconds.items():
            self.m.module_s.setdefault(name, []).append(seconds)

    def _add(self, reads, casts):
        m = self.m
        m.probe_steps += 1
        for key, count in reads.sites.items():
            m.host_reads[key] = m.host_reads.get(key, 0) + count
        m.host_read_s.append(reads.seconds)
        if reads.cuda_syncs is not None:
            m.cuda_syncs = (m.cuda_syncs or 0) + len(reads.cuda_syncs)
        m.casts += casts.casts
        m.weight_casts += len(casts.param_casts)
        m.cast_s.append(casts.seconds)
        for key, seconds in casts.matmuls.items():
            m.matmul_s[key] = m.matmul_s.get(key, 0.0) + seconds


def _initialize(model, optimizer, opt_level, half_dtype):
    """``amp_patch.initialize``; a model wrapped in DataParallel (which initialize refuses) is initialized bare
    and wrapped again the same way, as the job would have to."""
    if not isinstance(model, nn.DataParallel):
        return amp_patch.initialize(model, optimizer, opt_level=opt_level, half_dtype=half_dtype, verbosity=0)
    inner, optimizer = amp_patch.initialize(model.module, optimizer, opt_level=opt_level, half_dtype=half_dtype,
                                            verbosity=0)
    # (without devices DataParallel.__init__ stops before setting output_device and dim)
    again = nn.DataParallel(inner, device_ids=model.device_ids, output_device=getattr(model, "output_device", None),
                            dim=getattr(model, "dim", 0))
    return again, optimizer


def watched_modules(half):
    """The modules whose forward the probe steps time: DataParallel wrappers and what they wrap, and (when the
    opt level computes in half) the Linear/conv layers the alignment check flags."""
    def pick(model):
        found = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.DataParallel):
                found[name or "model"] = module
                found[f"{name}.module" if name else "module"] = module.module
            elif half and misaligned(module):
                found[name or "model"] = module
        return found
    return pick
