"""O2's half compute copies live for one call: an in-place edit a call makes to a weight (Embedding's max_norm, a
forward pre-hook constraining weights) reaches the fp32 param as in fp32, and calls from several threads take
turns instead of reading each other's copies."""
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_patch

O2 = dict(opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)


def _renormed_rows(amp):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8, max_norm=1.0), nn.Linear(8, 4))
    with torch.no_grad():
        model[0].weight.mul_(3)
    untouched = model[0].weight[7:].detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: only the renorm changes the weight
    if amp:
        amp_patch.initialize(model, opt, **O2)
    try:
        model(torch.arange(7)).float().pow(2).mean().backward()
        return model[0].weight.detach().clone(), untouched
    finally:
        if amp:
            amp_patch.deinitialize()


def test_embedding_max_norm_renormalizes_the_fp32_weight_as_in_fp32():
    fp32, untouched = _renormed_rows(amp=False)
    o2, _ = _renormed_rows(amp=True)
    assert o2.dtype is torch.float32
    norms = o2[:7].norm(dim=1)
    assert torch.allclose(norms, fp32[:7].norm(dim=1), atol=1e-2) and norms.max() <= 1.0 + 1e-2
    assert torch.equal(o2[7:], untouched)  # rows the lookup did not touch stay exact


def _clamped(amp, on_submodule):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    target = model[0] if on_submodule else model

    def constrain(module, args):
        with torch.no_grad():
            (module if on_submodule else module[0]).weight.clamp_(-0.2, 0.2)

    target.register_forward_pre_hook(constrain)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if amp:
        amp_patch.initialize(model, opt, **O2)
    try:
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
            opt.zero_grad()
            loss = F.mse_loss(model(x).float(), y)
            with amp_patch.scale_loss(loss, opt) if amp else _plain(loss) as scaled:
                scaled.backward()
            opt.step()
        with torch.no_grad():
            model(torch.randn(2, 8))  # one more forward applies the constraint
        return model[0].weight.detach().abs().max().item()
    finally:
        if amp:
            amp_patch.deinitialize()


class _plain:
    def __init__(self, loss):
        self.loss = loss

    def __enter__(self):
        return self.loss

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("on_submodule", [False, True], ids=["hook_on_model", "hook_on_submodule"])
def test_a_pre_hook_constraining_weights_in_place_constrains_the_fp32_params(on_submodule):
    assert _clamped(amp=False, on_submodule=on_submodule) == pytest.approx(0.2)
    assert _clamped(amp=True, on_submodule=on_submodule) == pytest.approx(0.2, abs=2e-3)


def test_a_background_eval_thread_does_not_disturb_training():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    amp_patch.initialize(model, opt, **O2)
    stop, errors, evals = threading.Event(), [], [0]

    def evaluate():
        x = torch.randn(8, 16)
        while not stop.is_set():
            try:
                with torch.no_grad():
                    assert torch.isfinite(model(x)).all()
                evals[0] += 1
            except Exception as exc:  # noqa: BLE001 - collected for the assertion below
                errors.append(repr(exc))
                return

    thread = threading.Thread(target=evaluate)
    thread.start()
    try:
        for _ in range(40):
            opt.zero_grad()
            loss = model(torch.randn(8, 16)).float().pow(2).mean()
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
            assert loss.requires_grad
            opt.step()
    finally:
        stop.set()
        thread.join()
        amp_patch.deinitialize()
    assert errors == [] and evals[0] > 0
    assert all(p.dtype is torch.float32 for p in model.parameters())
