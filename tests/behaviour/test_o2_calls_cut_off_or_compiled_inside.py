"""O2 calls that do not end through their own hooks: one cut off by a ``KeyboardInterrupt`` (torch runs the
always-called hooks for exceptions only), and models with a compiled submodule inside (the copies' collection must
not run inside dynamo's trace of it)."""
import logging

import pytest
import torch
from torch import nn

import amp_patch


def _o2(model, optimizer_class=torch.optim.SGD, **hyper):
    """``model`` and an optimizer of its params under O2 (bf16)."""
    optimizer = optimizer_class(model.parameters(), **hyper)
    return amp_patch.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.interrupt = False

    def forward(self, x):
        if self.interrupt:
            raise KeyboardInterrupt
        return torch.tanh(self.lin(x))


def _train(model, optimizer, x, steps, interrupt_at=None):
    for step in range(steps):
        model[1].interrupt = step == interrupt_at
        try:
            out = model(x)
        except KeyboardInterrupt:
            continue
        assert out.dtype is torch.float32  # (the model's outputs are cast at its outermost call)
        loss = out.pow(2).mean()
        with amp_patch.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert model[0].lin.weight.dtype is torch.float32
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("forward", ["class", "instance"])
def test_training_goes_on_after_a_call_cut_off_by_a_keyboard_interrupt(caplog, forward):
    """The cut-off call ends as it unwinds (the guard on the model class's forward runs the always-called hooks,
    as torch does for an exception); where the guard cannot see it (the model's ``forward`` an attribute of the
    instance, as accelerate's wrappers set it) its copies are dropped at the model's next call, with a warning.
    Either way the run then equals one that skipped that step (before, every later step trained the copies and the
    fp32 params never moved)."""
    runs = []
    for interrupt_at in (None, 1):
        torch.manual_seed(0)
        model = nn.Sequential(_Block(), _Block())
        if forward == "instance":
            model.forward = nn.Sequential.forward.__get__(model)
        model, optimizer = _o2(model, lr=0.3)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        try:
            with caplog.at_level(logging.WARNING, logger="amp_patch"):
                runs.append(_train(model, optimizer, x, 4 if interrupt_at is None else 5, interrupt_at))
        finally:
            amp_patch.deinitialize()
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert ("never ended" in caplog.text) is (forward == "instance")


class _Enc(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.head = _Enc(), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.enc(x) + x)


@pytest.mark.parametrize("where", ["submodule after initialize", "submodule before initialize", "leaf"])
def test_a_model_with_a_compiled_submodule_trains_as_the_eager_one(where):
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = _Model()
        compile_ = (lambda m: torch.compile(m, backend="eager")) if compiled else (lambda m: m)
        if where == "submodule before initialize":
            model.enc = compile_(model.enc)
        elif where == "leaf":
            model.enc.a = compile_(model.enc.a)
        model, optimizer = _o2(model, torch.optim.Adam, lr=0.01)
        if where == "submodule after initialize":
            model.enc = compile_(model.enc)
        x, y = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0, 1])
        try:
            for _ in range(3):
                loss = nn.functional.cross_entropy(model(x).float(), y)
                with amp_patch.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
                optimizer.zero_grad()
            runs.append([p.detach().clone() for p in model.head.parameters()])
        finally:
            amp_patch.deinitialize()
    assert all(torch.equal(a, b) for a, b in zip(*runs))


class _Owner(nn.Module):
    """Owns a param and calls a block: called on its own, it starts a call of its own."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.block = _Block()

    def forward(self, x):
        return self.block(x) * self.scale


def test_a_cut_off_call_started_by_a_submodule_is_dropped_at_the_models_next_call(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(_Owner(), _Block())
    model, optimizer = _o2(model, lr=0.3)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    try:
        model[0].block.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            model[0](x.bfloat16())
        model[0].block.interrupt = False
        with caplog.at_level(logging.WARNING, logger="amp_patch"):
            for _ in range(2):
                out = model(x)
                assert out.dtype is torch.float32
                with amp_patch.scale_loss(out.pow(2).mean(), optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
                optimizer.zero_grad()
                assert model[0].scale.dtype is torch.float32 and model[0].scale.grad is None
    finally:
        amp_patch.deinitialize()
    assert "never ended" in caplog.text


class _Recursive(nn.Module):
    """A recursive forward that catches a ``KeyboardInterrupt`` of its inner call and calls it again."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.interrupts = 0

    def forward(self, x, depth=1):
        if depth == 0:
            if self.interrupts:
                self.interrupts -= 1
                raise KeyboardInterrupt
            return self.lin(x)
        try:
            h = self(x, depth - 1)
        except KeyboardInterrupt:
            h = self(x, depth - 1)
        return torch.tanh(self.lin(h))


def test_an_inner_call_cut_off_and_retried_inside_the_forward_ends_with_the_outermost_call(caplog):
    """The outermost call's hook ends the call whatever happened inside it: the step's backward and optimizer see
    the fp32 params, no warning, and the run equals one without the interruption."""
    runs = []
    for interrupts in (0, 1):
        torch.manual_seed(0)
        model = _Recursive()
        model, optimizer = _o2(model, lr=0.3)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        try:
            with caplog.at_level(logging.WARNING, logger="amp_patch"):
                for step in range(3):
                    model.interrupts = interrupts if step == 1 else 0
                    out = model(x)
                    assert out.dtype is torch.float32 and model.lin.weight.dtype is torch.float32
                    with amp_patch.scale_loss(out.pow(2).mean(), optimizer) as scaled:
                        scaled.backward()
                    optimizer.step()
                    optimizer.zero_grad()
            runs.append([p.detach().clone() for p in model.parameters()])
        finally:
            amp_patch.deinitialize()
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert "never ended" not in caplog.text


def test_a_fused_module_whose_moved_hook_is_not_always_called_ends_a_call_that_raises():
    """``fuse_modules`` re-registers the last module's hooks without ``always_call``: the fused module's call must
    still end when its forward raises (a shape probe)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 1), nn.BatchNorm1d(3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                            keep_batchnorm_fp32=False, verbosity=0)
    try:
        model.eval()
        torch.ao.quantization.fuse_modules(model, [["0", "1"]], inplace=True)
        with pytest.raises(RuntimeError):
            model[0](torch.randn(5, 7, 4).bfloat16())  # (wrong channels)
        assert model[0].weight.dtype is torch.float32
        out = model(torch.randn(5, 2, 4))
        assert out.dtype is torch.float32 and model[4].weight.dtype is torch.float32
    finally:
        amp_patch.deinitialize()
