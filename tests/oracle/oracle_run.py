"""Run one oracle program three ways (fp32, native ``torch.autocast``, amp_patch) and record what it computes.

A run returns a *trace*: ``[(label, value)]`` of every model output, loss, gradient (after the last micro-batch
of a step, before ``optimizer.step()``) and parameter/state-dict value the program produces, in order. An
exception ends the run with ``(label, Raised(...))``. ``oracle_compare`` compares traces.

Runners differ only in how precision is handled:

- ``Fp32Runner``: the program as written.
- ``NativeRunner``: the model forward and the loss inside ``torch.autocast("cpu", dtype)``; the backward of
  ``loss.float() * scale`` outside it, grads multiplied by ``1 / scale`` after the last micro-batch, the step
  skipped when a grad is not finite (what amp_patch's static scaler does; the scale is a power of two, so the
  scaling is exact).
- ``AmpRunner``: ``amp_patch.initialize(model, optimizer, opt_level, op_lists=..., half_dtype, loss_scale=scale)``
  and ``amp_patch.scale_loss``; grads and params are read from ``amp_patch.master_params`` (the fp32 masters
  under O2).
"""
import contextlib
import copy
import dataclasses
import io
import warnings

import torch
import torch.nn.functional as F
from oracle_program import DTYPES, batch, build_model, random_like
from oracle_text import PARAM_NAMES

import amp_patch

LOSSES = {"mse": F.mse_loss, "l1": F.l1_loss, "smooth_l1": F.smooth_l1_loss, "cross_entropy": F.cross_entropy,
          "sum": lambda out, y: (out * out).sum()}


@dataclasses.dataclass(frozen=True)
class Raised:
    type: str
    message: str


def _native_fp32_region():
    return torch.autocast("cpu", enabled=False)


class Fp32Runner:
    name = "fp32"
    fp32_region = None  # keep OracleNet's (nothing to turn off)

    def setup(self, program, model, optimizer):
        return model, optimizer

    def region(self):
        return contextlib.nullcontext()

    def backward(self, loss, optimizer):
        loss.backward()

    def finish_backward(self, optimizer):
        pass

    def step(self, optimizer):
        optimizer.step()

    def masters(self, model, optimizer):
        return list(model.parameters())

    def teardown(self):
        pass


class NativeRunner(Fp32Runner):
    name = "native"
    fp32_region = staticmethod(_native_fp32_region)

    def setup(self, program, model, optimizer):
        self.half, self.scale, self.skip = DTYPES[program.dtype], program.scale, False
        return model, optimizer

    def region(self):
        return torch.autocast("cpu", dtype=self.half)

    def backward(self, loss, optimizer):
        (loss.float() * self.scale).backward()

    def finish_backward(self, optimizer):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        for g in grads:
            g.mul_(1.0 / self.scale)
        self.skip = not all(bool(torch.isfinite(g).all()) for g in grads)

    def step(self, optimizer):
        if not self.skip:
            optimizer.step()


class AmpRunner(Fp32Runner):
    fp32_region = staticmethod(amp_patch.disable_casts)

    def __init__(self, opt_level="O1", op_lists="torch_cpu"):
        self.opt_level, self.op_lists = opt_level, op_lists
        self.name = f"amp_patch {opt_level}" + (f" op_lists={op_lists!r}" if opt_level == "O1" else "")

    def setup(self, program, model, optimizer):
        extra = {"op_lists": self.op_lists} if self.opt_level == "O1" else {}
        return amp_patch.initialize(model, optimizer, opt_level=self.opt_level, half_dtype=DTYPES[program.dtype],
                                    loss_scale=program.scale, verbosity=0, **extra)

    def backward(self, loss, optimizer):
        with amp_patch.scale_loss(loss, optimizer) as scaled:
            scaled.backward()

    def masters(self, model, optimizer):
        return list(amp_patch.master_params(optimizer))

    def teardown(self):
        amp_patch.deinitialize()


@dataclasses.dataclass
class _Run:
    program: object
    runner: object
    model: object
    optimizer: object
    trace: list

    def record(self, label, value):
        if isinstance(value, torch.Tensor):
            value = value.detach().clone()
        self.trace.append((label, value))

    def record_state(self, label, module):
        for key, value in module.state_dict().items():
            self.record(f"{label}[{key}]", value)

    def forward(self, module, x):
        with self.runner.region():
            return module(x)


def _train(run, i, n, seed):
    run.optimizer.zero_grad()
    for k in range(n):
        x, y = batch(seed + k, run.program.loss)
        with run.runner.region():
            out = run.model(x)
            loss = LOSSES[run.program.loss](out, y)
            loss = loss / n if n > 1 else loss
        run.record(f"step {i} micro-batch {k}: out", out)
        run.record(f"step {i} micro-batch {k}: loss", loss)
        run.runner.backward(loss, run.optimizer)
    run.runner.finish_backward(run.optimizer)
    names = [name for name, _ in run.model.named_parameters()]
    for name, p in zip(names, run.runner.masters(run.model, run.optimizer)):
        run.record(f"step {i}: grad of {name}", p.grad)
    run.runner.step(run.optimizer)
    for name, p in zip(names, run.runner.masters(run.model, run.optimizer)):
        run.record(f"step {i}: {name} after step", p)


def _eval(run, i, seed, how):
    """how: 0 under no_grad, 1 under inference_mode, 2 with grad on and no backward (a metric, a probe)."""
    x, _ = batch(seed, run.program.loss)
    mode = (torch.no_grad, torch.inference_mode, contextlib.nullcontext)[how]
    with mode():
        run.record(f"step {i}: eval out", run.forward(run.model, x))


def _freeze(run, i, target, flag):
    dict(run.model.named_parameters())[PARAM_NAMES[target]].requires_grad_(bool(flag))


def _data(run, i, how, target, seed):
    params = dict(run.model.named_parameters())
    p = params[PARAM_NAMES[target]]
    if how == 0:
        p.data = random_like(seed, p)
    elif how == 4:
        with torch.no_grad():
            p.mul_(0.5)
    elif how == 5:
        with torch.no_grad():
            p.set_(random_like(seed, p))
    elif how == 1:
        p.data.copy_(random_like(seed, p))
    elif how == 2:
        vec = torch.nn.utils.parameters_to_vector(run.model.parameters())
        torch.nn.utils.vector_to_parameters(random_like(seed, vec), run.model.parameters())
    elif how == 3:
        for q in params.values():
            q.data.clamp_(-0.2, 0.2)


def _random_state(module, seed):
    return {k: random_like(seed + j, v) for j, (k, v) in enumerate(module.state_dict().items())}


def _deepcopy(run, i, seed):
    clone = copy.deepcopy(run.model)
    x, _ = batch(seed, run.program.loss)
    with torch.no_grad():
        run.record(f"step {i}: clone's out", run.forward(clone, x))
    clone.load_state_dict(_random_state(clone, seed + 1))
    run.record_state(f"step {i}: clone.state_dict() after its load", clone)
    run.record_state(f"step {i}: model.state_dict() after the clone's load", run.model)
    with torch.no_grad():
        run.record(f"step {i}: model's out after the clone's load", run.forward(run.model, x))
        run.record(f"step {i}: clone's out after its load", run.forward(clone, x))


def _state_dict(run, i, how, seed):
    sd = run.model.state_dict()
    if how == 1:
        sd = _random_state(run.model, seed)
    elif how == 2:
        f = io.BytesIO()
        torch.save(sd, f)
        f.seek(0)
        sd = torch.load(f)
    run.model.load_state_dict(sd)
    run.record_state(f"step {i}: state_dict() after load", run.model)


STEPS = {"train": _train, "eval": _eval, "data": _data, "deepcopy": _deepcopy, "state_dict": _state_dict,
         "freeze": _freeze}
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.5),
              "adam": lambda params: torch.optim.Adam(params, lr=0.01)}


def run_program(program, runner):
    """The trace of ``program`` under ``runner``; an exception ends it with a ``Raised`` entry."""
    model = build_model(program)
    if runner.fp32_region is not None:
        model.fp32_region = runner.fp32_region
    run = _Run(program, runner, model, OPTIMIZERS[program.optim](model.parameters()), [])
    label = "initialize"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.model, run.optimizer = runner.setup(program, run.model, run.optimizer)
            for i, step in enumerate(program.steps):
                label = f"step {i} ({step.kind})"
                STEPS[step.kind](run, i, *step.args)
    except Exception as exc:  # noqa: BLE001 - an exception is an observation, compared across runners
        run.trace.append((label, Raised(type(exc).__name__, str(exc).split("\n")[0][:300])))
    finally:
        runner.teardown()
    return run.trace
