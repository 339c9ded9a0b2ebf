"""O2 calls that do not end through their own hooks: one cut off by a ``KeyboardInterrupt`` (torch runs the
always-called hooks for exceptions only), and models with a compiled submodule inside (the copies' collection must
not run inside dynamo's trace of it)."""
import logging

import pytest
import torch
from torch import nn

import amp_patch


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
            loss = model(x).float().pow(2).mean()
        except KeyboardInterrupt:
            continue
        with amp_patch.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert model[0].lin.weight.dtype is torch.float32
    return [p.detach().clone() for p in model.parameters()]


def test_training_goes_on_after_a_call_cut_off_by_a_keyboard_interrupt(caplog):
    """The cut-off call's copies are dropped at the model's next call, with a warning; the run then equals one
    that skipped that step (before, every later step trained the copies and the fp32 params never moved)."""
    runs = []
    for interrupt_at in (None, 1):
        torch.manual_seed(0)
        model = nn.Sequential(_Block(), _Block())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
        model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                                verbosity=0)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        try:
            with caplog.at_level(logging.WARNING, logger="amp_patch"):
                runs.append(_train(model, optimizer, x, 4 if interrupt_at is None else 5, interrupt_at))
        finally:
            amp_patch.deinitialize()
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert "never ended" in caplog.text


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
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                                verbosity=0)
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
