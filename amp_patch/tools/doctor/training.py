"""The doctor's training runs: the job trained in this process, with the per-step history and, at the first
step that fails for a reason other than the scaler's warm-up, a snapshot (weights + batch) to replay."""
import contextlib
import dataclasses
import logging
import math

import torch

import amp_patch as frontend

from ... import scale_loss
from ..experiment.models import as_job
from ..experiment.runner import Config, fixed_batches

# "warmup": history()'s consecutive backoffs from the initial scale before the first applied step; "backoff": skips
# for non-finite gradients alone (finite loss, no forward overflow) right after which the scaler applied a step at
# the backed-off scale, which is the dynamic scaler's documented rhythm (grow, overflow, back off until it fits).
_SCALE_FINDING = frozenset(("warmup", "backoff"))


@dataclasses.dataclass
class Failure:
    """The first failing step: its history record and what is needed to replay it."""

    step: int
    kind: str
    cause: str
    state: dict
    batch: list
    intended: dict = None  # the float32 replay's non-finite values (masks): not failures (doctor.locate)


@dataclasses.dataclass
class Run:
    """One training run of the job."""

    opt_level: str
    losses: list = dataclasses.field(default_factory=list)
    skips: list = dataclasses.field(default_factory=list)  # {"step", "kind", "cause", "scale"}
    failure: Failure = None
    final_scale: float = None

    @property
    def final_loss(self):
        return self.losses[-1] if self.losses else None

    @property
    def warmup_skips(self):
        """The scaler finding its scale: backoffs before the first applied step, and later ones it recovered from."""
        return [s for s in self.skips if s["kind"] in _SCALE_FINDING]

    @property
    def bad_skips(self):
        return [s for s in self.skips if s["kind"] not in _SCALE_FINDING]

    @property
    def healthy(self):
        final = self.final_loss
        return not self.bad_skips and final is not None and math.isfinite(final)


def train(job, *, opt_level, half_dtype, steps, op_lists=None, seed=0):
    """Train ``job`` for ``steps`` steps under ``opt_level`` (the experiment's seeding and batching)."""
    job = as_job(job)
    torch.manual_seed(seed)
    model = job.model_fn()
    optimizer = job.optimizer_fn(model)
    torch.manual_seed(seed + 1)
    batches = fixed_batches(job, Config(steps=steps, half_dtype=half_dtype, seed=seed))
    run = Run(opt_level)
    options = {"opt_level": opt_level, "verbosity": 0}
    if opt_level != "O0":
        options.update(half_dtype=half_dtype, diagnose_overflow=True, op_lists=op_lists)
    with _quiet_overflow_lines():
        return _train(model, optimizer, job, batches, steps, options, run)


@contextlib.contextmanager
def _quiet_overflow_lines():
    """The report tells every skip and its cause: the per-overflow log lines would only repeat it."""
    logger = logging.getLogger("amp_patch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _train(model, optimizer, job, batches, steps, options, run):
    model, optimizer = frontend.initialize(model, optimizer, **options)
    try:
        model.train()
        for step in range(steps):
            batch = list(next(batches))
            loss = _step(model, optimizer, job, batch)
            _record(run, step, loss, model, batch)
        run.final_scale = frontend.loss_scale()
    finally:
        frontend.deinitialize()
    return run


def _step(model, optimizer, job, batch):
    optimizer.zero_grad(set_to_none=True)
    loss = job.loss_fn(model(*batch[:-1]), batch[-1])
    with scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    return loss


def _record(run, step, loss, model, batch):
    value = float(loss.detach().float())
    run.losses.append(value)
    records = frontend.history()
    record = records[-1] if records else None
    if record is None or not record["skipped"]:
        _recovered(run, step)
        return
    run.skips.append({"step": step, "kind": record["cause_kind"], "cause": record["cause"],
                      "scale": record["scale_before"]})
    if run.failure is None and record["cause_kind"] != "warmup":
        # a skipped step left the weights as they were before it: this is the state that failed
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        run.failure = Failure(step, record["cause_kind"], record["cause"], state,
                              [t.clone() if torch.is_tensor(t) else t for t in batch])


def _recovered(run, step):
    """Step ``step`` applied: the gradient-only skips just before it (consecutive, ending at ``step - 1``) were the
    scaler backing off until the gradients fit, not a fault; a failure snapshot taken at one of them is dropped."""
    backed_off = []
    for skip in reversed(run.skips):
        if skip["step"] != step - 1 - len(backed_off) or skip["kind"] != "grads":
            break
        backed_off.append(skip)
    for skip in backed_off:
        skip["kind"] = "backoff"
    if backed_off and run.failure is not None and run.failure.step >= backed_off[-1]["step"]:
        run.failure = None
