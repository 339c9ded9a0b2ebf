"""scale_loss's steady path (the usual block skips the checks its state makes idle), with the usual step's hooks and
the check-only unscale at a scale of 1.0, leaves exactly what the general paths leave: random training programs
(gradient accumulation, zero_grad both ways, overflows, an exception inside the block, loss ids, delayed unscaling,
optimizers passed in a list, steps skipped or not, a plain backward) run both ways, and every step's params, grads,
loss scales, step history, skip flags and what amp_patch logged agree bitwise, errors included (a block nested in
another on the same optimizer, refused on both)."""
import contextlib
import logging
import random
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import amp_patch
from amp_patch import legacy
from amp_patch.scaling import grad_protocol, optimizer_state, unscale
from amp_patch.session import scale_loss as scale_loss_module

CONFIGS = [  # (API, opt level, half dtype, loss scale[, initialize's other options])
    ("own", "O1", torch.bfloat16, None),
    ("own", "O1", torch.float16, "dynamic", {"growth_interval": 2, "hysteresis": 2}),  # the scale moves both ways
    ("own", "O1", torch.bfloat16, "dynamic", {"diagnose_overflow": True}),
    ("own", "O1", torch.float16, "dynamic"),
    ("own", "O2", torch.float16, "dynamic"),
    ("own", "O3", torch.float16, 128.0),
    ("own", "O1", torch.float16, 1.0),
    ("apex", "O1", torch.float16, "dynamic"),  # Apex's scaler rules (every exit counts)
    ("apex", "O1", torch.float16, 1.0),  # Apex's early return: no scaler update at a static 1.0
]
OPS = ["block", "block", "block", "block_inf", "block_raise", "block_listed", "block_loss1", "block_delayed",
       "block_nested", "zero", "zero_keep", "step", "step", "step_closure", "plain_backward",
       "block_bad_grad", "block_no_grad", "block_float_raises", "block_inf_first", "block_nan_last",
       "block_half_loss", "block_loss_backward", "block_half_loss_backward"]


class _Boom(Exception):
    pass


class _FloatRaises(torch.Tensor):
    def float(self):
        raise RuntimeError("loss.float() failed")


def _program(seed, length=14):
    rng = random.Random(seed)
    return [rng.choice(OPS) for _ in range(length)]


def _bits(t):
    if t is None:
        return None
    t = t.detach()
    return (t.dtype, tuple(t.shape), t.reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32).tolist())


def _snapshot(model, optimizer):
    return {
        "params": [_bits(p) for p in model.parameters()],
        "grads": [_bits(p.grad) for p in model.parameters()],
        "scales": [amp_patch.loss_scale(i) for i in range(2)],
        "history": amp_patch.history(),
        "skipped": amp_patch.last_step_skipped(optimizer),
        "overflow": repr(amp_patch.last_overflow()),
        "state": repr(amp_patch.state_dict()),
    }


def _loss(model, x, y, inf=False):
    loss = F.mse_loss(model(x).float(), y)
    return loss * float("inf") if inf else loss


def _apply(op, model, optimizer, x, y, scale_loss):
    if op == "zero":
        optimizer.zero_grad(set_to_none=True)
    elif op == "zero_keep":
        optimizer.zero_grad(set_to_none=False)
    elif op == "step":
        optimizer.step()
    elif op == "plain_backward":  # (scale_loss forgotten: the next step warns once where that trains unscaled)
        _loss(model, x, y).backward()
    elif op == "step_closure":
        def closure():
            optimizer.zero_grad()
            loss = _loss(model, x, y)
            with scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            return loss
        optimizer.step(closure)
    elif op == "block_bad_grad":
        _bad_grad_block(model, optimizer, x, y, scale_loss)
    elif op == "block_no_grad":  # (a scaled loss needs grad for its probe: refused where the scale is not 1)
        loss = _loss(model, x, y)
        with torch.no_grad(), scale_loss(loss, optimizer) as scaled:
            with torch.enable_grad():
                scaled.backward()
    else:
        loss = _loss(model, x, y, inf=op == "block_inf")
        if op == "block_float_raises":  # the entry fails half-way: loss.float() raises
            loss = loss.as_subclass(_FloatRaises)
        if op.startswith("block_half_loss"):  # a loss in a half dtype (or float64: not the plain fp32 loss)
            loss = loss.to(torch.float16 if loss.dtype is torch.float32 else torch.float32)
        kwargs = {"loss_id": 1} if op == "block_loss1" else {"delay_unscale": True} if op == "block_delayed" else {}
        with scale_loss(loss, [optimizer] if op == "block_listed" else optimizer, **kwargs) as scaled:
            # the loss itself backwarded inside the block: refused where the scale is not 1 (grads 1/scale small)
            (loss if op.endswith("loss_backward") else scaled).backward()
            if op in ("block_inf_first", "block_nan_last"):  # one element of one grad: each grad is checked
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                grads[0 if op == "block_inf_first" else -1].view(-1)[0] = float("inf" if op[6] == "i" else "nan")
            if op == "block_raise":
                raise _Boom
            if op == "block_nested":  # (refused: the outer block is still open)
                with scale_loss(_loss(model, x, y), optimizer) as inner:
                    inner.backward()


def _bad_grad_block(model, optimizer, x, y, scale_loss):
    """The exit's check raises (the in-place kernel refuses an expanded grad); the grads stay pending, so the step
    checks them again and raises too, leaving the params as they were. Then the grad is made sane again."""
    said = []
    for stage in ("exit", "step"):
        try:
            if stage == "exit":
                with scale_loss(_loss(model, x, y), optimizer) as scaled:
                    scaled.backward()
                    grad = model[2].bias.grad
                    model[2].bias.grad = grad[:1].expand_as(grad)
            else:
                optimizer.step()
            said.append(f"{stage}: no error")
        except RuntimeError as exc:
            said.append(f"{stage}: {exc}")
    model[2].bias.grad = None
    raise RuntimeError("; ".join(said))


@contextlib.contextmanager
def _said():
    """What the body warned or logged (amp_patch's logger), in order."""
    said = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("amp_patch")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield said
        said.extend(str(w.message) for w in caught)
    finally:
        logger.removeHandler(handler)


def _run(config, program):
    api, level, dtype, loss_scale = config[:4]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"loss_scale": loss_scale} if loss_scale is not None else {}
    options.update(config[4] if len(config) > 4 else {})
    if api == "apex":
        model, optimizer = legacy.amp.initialize(model, optimizer, opt_level=level, num_losses=2, verbosity=0,
                                                 **options)
        scale_loss = legacy.amp.scale_loss
    else:
        model, optimizer = amp_patch.initialize(model, optimizer, opt_level=level, half_dtype=dtype, num_losses=2,
                                                verbosity=0, **options)
        scale_loss = amp_patch.scale_loss
    data = torch.Generator().manual_seed(1)
    log = []
    try:
        for op in program:
            x, y = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
            try:
                with _said() as said:
                    _apply(op, model, optimizer, x, y, scale_loss)
                outcome = said or None
            except _Boom:
                outcome = "boom"
            except (amp_patch.errors.UsageError, RuntimeError) as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            log.append((op, outcome, _snapshot(model, optimizer)))
    finally:
        amp_patch.deinitialize()
    return log


def _general_paths_only(monkeypatch):
    """Every usual-case shortcut off: the steady block, the usual step's hooks, the one-kernel unscale and check."""
    monkeypatch.setattr(scale_loss_module, "_steady_state", lambda *args: None)
    monkeypatch.setattr(optimizer_state.OptimizerState, "_pre_step", lambda self, optimizer, args, kwargs: (
        optimizer_state.OptimizerState._general_pre_step(self, optimizer, args, kwargs, sys._getframe(1))))
    monkeypatch.setattr(grad_protocol, "unscale_usual_", unscale.unscale_collected_)


def _config_id(config):
    return "-".join([config[0], config[1], str(config[2])[6:], str(config[3])] + sorted(config[4:] and config[4]))


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
@pytest.mark.parametrize("seed", range(6))
def test_a_random_program_leaves_the_same_state_on_the_steady_and_general_paths(config, seed, monkeypatch):
    program = ["block", "step"] + _program(seed)  # (the first block takes the general path: one-time checks)
    taken = {"block": [], "step": [], "general step": []}
    steady_state, general_pre_step = scale_loss_module._steady_state, optimizer_state.OptimizerState._general_pre_step

    def counting(*args):
        state = steady_state(*args)
        taken["block"].append(state is not None)
        return state

    def counting_general_step(self, *args):
        taken["general step"].append(1)
        return general_pre_step(self, *args)

    monkeypatch.setattr(scale_loss_module, "_steady_state", counting)
    monkeypatch.setattr(optimizer_state.OptimizerState, "_general_pre_step", counting_general_step)
    handle = register_optimizer_step_pre_hook(lambda *args: taken["step"].append(1))
    try:
        steady = _run(config, program)
    finally:
        handle.remove()
    assert any(taken["block"]), "the steady path never ran: this program cannot tell the two paths apart"
    assert len(taken["step"]) > len(taken["general step"]), ("the usual step never ran: this program cannot tell "
                                                             "the two paths apart")
    _general_paths_only(monkeypatch)
    general = _run(config, program)
    for i, (got, want) in enumerate(zip(steady, general)):
        assert got == want, f"after op {i} ({program[i]}) of {program}: the steady path left {got}, the general {want}"


class _SetsNativeDtype(nn.Module):
    """A forward that sets native autocast's dtype itself and may raise (leaving its native region open)."""

    def __init__(self):
        super().__init__()
        self.linear, self.fail = nn.Linear(4, 2), False

    def forward(self, x):
        torch.set_autocast_dtype("cpu", torch.float16)
        if self.fail:
            raise _Boom
        return self.linear(x)


def _region_left_open_in_a_block():
    torch.manual_seed(0)
    model = _SetsNativeDtype()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O1", half_dtype=torch.bfloat16,
                                            verbosity=0)
    seen = []
    try:
        for fail in (False, False, True):  # (the first block takes the general path: one-time checks)
            with amp_patch.scale_loss(model(torch.randn(3, 4)).float().sum(), optimizer) as scaled:
                scaled.backward()
                model.fail = fail
                with contextlib.suppress(_Boom):
                    model(torch.randn(3, 4))
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                         torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype))
            optimizer.step()
            optimizer.zero_grad()
            model.fail = False
    finally:
        amp_patch.deinitialize()
    return seen


def test_a_native_region_a_raising_forward_left_open_in_the_block_is_synced_at_exit_as_on_the_general_path(
        monkeypatch):
    steady = _region_left_open_in_a_block()
    _general_paths_only(monkeypatch)
    assert steady == _region_left_open_in_a_block()
