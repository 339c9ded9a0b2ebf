"""Random programs of train steps, forwards that raise or are cut off by Ctrl-C, checkpoint loads, eval forwards,
calls of a submodule on its own and checkpoint saves give what a shadow that never failed gives, bitwise: native
``torch.autocast`` on an fp32 copy (O1), or the program O2 amounts to written out (each param cast to bfloat16 for
the call, inputs cast to it, outputs back to fp32). The model is OpenNMT-py's shape, passed with its generator
(``initialize([model, model.generator], ...)``), with a layer in each that raises when armed.

A call's end is tied to hooks that an abnormal exit can skip (Ctrl-C runs none); each state that end resets (the
O1 casting region and native autocast's cast cache, O2's compute copies, the count of open outer forwards) read
stale afterwards would show here as a wrong output, a half checkpoint or a param that is not the optimizer's."""
import copy
import os
import random

import pytest
import torch
import torch.nn as nn
from tests_support import forward_on_instance

import amp_patch

HALF = torch.bfloat16
LR = 0.05  # (with the loads' scale, no program diverges: amp_patch skips a step on inf/NaN grads, the shadow not)
SEEDS = int(os.environ.get("AMP_PATCH_PROGRAM_SEEDS", "32"))
OPS = ("train", "raise", "interrupt", "load", "eval", "eval_grad", "sub", "save")
GUARDED_OPS = ("edit", "infer", "raw")  # what only the guard on the class's forward makes right after a Ctrl-C
SETUPS = {"O1-hybrid": dict(opt_level="O1", cast_engine="hybrid"),
          "O1-python": dict(opt_level="O1", cast_engine="python"),
          "O1-cast-outputs": dict(opt_level="O1", cast_model_outputs=torch.float32),
          "O2": dict(opt_level="O2")}


class Cut(nn.Module):
    """Passes its input through, or raises the exception it is armed with."""

    armed = None

    def forward(self, x):
        if self.armed is not None:
            raise self.armed
        return x


class Translator(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Cut(), nn.Linear(8, 6))
        self.generator = nn.Sequential(nn.Linear(6, 3), Cut())

    def forward(self, x):
        return self.body(x)


def _cuts(model):
    return model.body[2], model.generator[1]


class _Shadow:
    """The same model and optimizer run without amp_patch and never interrupted."""

    def __init__(self, model, level, cast_outputs):
        self.model, self.level, self.cast_outputs = copy.deepcopy(model), level, cast_outputs
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def _call(self, module, x, passed=True):
        """``module(x)`` as amp_patch runs a model passed to initialize (``passed``) or a layer called on its own."""
        if self.level == "O1":
            with torch.autocast("cpu", dtype=HALF):
                out = module(x)
            return out.float() if self.cast_outputs and passed else out
        swapped = [(m, n, p) for m in module.modules() for n, p in m._parameters.items() if p is not None]
        for m, n, p in swapped:
            m._parameters[n] = p.to(HALF)
        try:
            return module(x.to(HALF)).float()
        finally:
            for m, n, p in swapped:
                m._parameters[n] = p

    def outputs(self, x):
        return self._call(self.model.generator, self._call(self.model, x))

    def sub(self, x):
        return self._call(self.model.body[0], x, passed=False) if self.level == "O1" else self._half_linear(x)

    def _half_linear(self, x):
        layer = self.model.body[0]
        return nn.functional.linear(x.to(HALF), layer.weight.to(HALF), layer.bias.to(HALF))


def _loss(out):
    return out.float().pow(2).mean()


def _run_op(op, model, opt, shadow, rng, gen):
    x = torch.randn(3, 4, generator=gen)
    if op == "train":
        loss = _loss(model.generator(model(x)))
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        _loss(shadow.outputs(x)).backward()
        shadow.opt.step()
        shadow.opt.zero_grad()
    elif op in ("raise", "interrupt"):
        cut = rng.choice(_cuts(model))
        cut.armed = RuntimeError("a bad batch") if op == "raise" else KeyboardInterrupt()
        try:
            with pytest.raises((RuntimeError, KeyboardInterrupt)):
                model.generator(model(x)).sum().backward()
        finally:
            cut.armed = None
    elif op == "load":
        state = {k: torch.randn(v.shape, generator=gen) * 0.5 for k, v in shadow.model.state_dict().items()}
        model.load_state_dict(state)
        shadow.model.load_state_dict(state)
    elif op in ("eval", "eval_grad"):
        with torch.set_grad_enabled(op == "eval_grad"):
            got, want = model.generator(model(x)), shadow.outputs(x)
        assert got.dtype == want.dtype and torch.equal(got, want), op
    elif op == "edit":  # in place, under no_grad, through the optimizer's params (WGAN's clipping, say)
        with torch.no_grad():
            for p, q in zip(opt.param_groups[0]["params"], shadow.opt.param_groups[0]["params"]):
                p.mul_(0.5)
                q.mul_(0.5)
    elif op == "infer":
        with torch.inference_mode():
            got, want = model.generator(model(x)), shadow.outputs(x)
        assert got.dtype == want.dtype and torch.equal(got, want), op
        _assert_native_autocast_off()
    elif op == "raw":
        _assert_native_autocast_off()
    elif op == "sub":
        got = model.body[0](x if shadow.level == "O1" else x.to(HALF))  # (not a model passed: no casts of its own)
        want = shadow.sub(x)
        assert got.dtype == want.dtype and torch.equal(got, want), op
    else:  # save
        got, want = model.state_dict(), shadow.model.state_dict()
        assert all(got[k].dtype is torch.float32 and torch.equal(got[k], want[k]) for k in want), op
        assert [id(p) for p in model.parameters()] == [id(p) for p in opt.param_groups[0]["params"]], op


def _assert_native_autocast_off():
    """Outside the model's forwards an op amp_patch does not patch runs as written (native autocast is off)."""
    a = torch.ones(2, 2)
    assert torch.ops.aten.mm.default(a, a).dtype is torch.float32, "native autocast left on"


FOLLOW_UPS = (("sub",), ("save",), ("eval",), ("eval_grad",), ("train",), ("load", "sub"), ("load", "save"),
              ("load", "eval"))
GUARDED_FOLLOW_UPS = (("edit", "sub"), ("edit", "eval"), ("infer", "raw"), ("raw",), ("edit", "save"))


def _program(seed, guarded, length=12):
    """Random ops; each failed forward is followed by a change and a read of what it may have left (a pair of
    ops, or one read), then the program goes on."""
    rng, ops = random.Random(seed), []
    follow_ups = FOLLOW_UPS + GUARDED_FOLLOW_UPS if guarded else FOLLOW_UPS
    while len(ops) < length:
        ops.append(rng.choice(OPS + GUARDED_OPS if guarded else OPS))
        if ops[-1] in ("raise", "interrupt"):
            ops += rng.choice(follow_ups)
    return ops + ["eval", "save"]


@pytest.mark.parametrize("forward", ["class", "instance"])
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("seed", range(SEEDS))
def test_a_program_with_failed_and_interrupted_forwards_matches_one_that_never_failed(setup, seed, forward):
    """``forward``: "class", the models' forwards as their classes define them (amp_patch's guard ends a call cut
    off by Ctrl-C as it unwinds); "instance", set on the instances (the guard cannot see the interrupt, and the
    checks for a call whose frame is gone end it later: until then native autocast stays on in the thread for ops
    amp_patch does not patch, an in-place edit of a weight is not seen, and an ``inference_mode`` block switches the
    region it ends on again: those ops are left out there, as documented)."""
    options = SETUPS[setup]
    torch.manual_seed(seed)
    model = Translator()
    if forward == "instance":
        forward_on_instance(model)
        forward_on_instance(model.generator)
    shadow = _Shadow(model, options["opt_level"], "cast_model_outputs" in options)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    amp_patch.initialize([model, model.generator], opt, half_dtype=HALF, verbosity=0, **options)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    done = []
    try:
        for op in _program(seed, guarded=forward == "class"):
            done.append(op)
            _run_op(op, model, opt, shadow, rng, gen)
    except AssertionError as e:
        raise AssertionError(f"program {done} (seed {seed}): {e}") from None
    finally:
        amp_patch.deinitialize()
    _assert_native_autocast_off()  # (nothing of the session is left in the thread)
