"""A plain ``loss.backward()`` (no ``scale_loss``) under the apex alias's O2 and O3 trains (SimCLR's pattern), where
Apex's O2 silently never applied the half grads to its fp32 masters. Under O2 the half grads reach the masters as
a ``scale_loss`` at a static loss scale of 1 would bring them, with one warning; O3 has no masters and trains the
half params directly (a warning only where a loss scale other than 1 is skipped). Bitwise against the same
program with ``scale_loss`` at ``loss_scale=1``, on runs whose grads stay finite; BatchNorm stays fp32 (keep_bn)."""
import logging

import pytest
import torch

import amp_patch
from amp_patch.legacy import amp


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _train(level, plain, loss_scale=None, optimizer=torch.optim.SGD, steps=4):
    model = _net()
    opt = optimizer(model.parameters(), lr=0.05, **({"momentum": 0.9} if optimizer is torch.optim.SGD else {}))
    extra = {} if loss_scale is None else {"loss_scale": loss_scale}
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **extra)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(8, 6, generator=gen).half()).float().pow(2).mean()
        opt.zero_grad()
        if plain:
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    skipped = amp_patch.last_step_skipped(opt)
    amp_patch.deinitialize()
    return weights, skipped


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "scale_loss" in r.getMessage()]


@pytest.mark.parametrize("level,optimizer", [("O2", torch.optim.SGD), ("O2", torch.optim.Adam),
                                             ("O3", torch.optim.SGD)])  # (O3 Adam in float16: eps underflows, NaN)
def test_a_plain_backward_trains_bitwise_as_scale_loss_at_static_scale_one(level, optimizer, caplog):
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        plain, skipped = _train(level, plain=True, optimizer=optimizer)
    warned = _warnings(caplog)
    caplog.clear()
    scaled, _ = _train(level, plain=False, loss_scale=1.0, optimizer=optimizer)
    start = _net().state_dict()
    assert not skipped
    assert all(torch.equal(plain[k], scaled[k]) for k in plain)
    assert any(not torch.equal(plain[k].float(), start[k]) for k in plain if k.endswith("weight"))  # it trained
    if level == "O2":
        (message,) = warned  # (once, over four steps)
        assert message.startswith(f"{optimizer.__name__}.step() under O2: the half model params have grads no "
                                  "amp_patch.scale_loss() block produced")
        assert "static loss scale of 1" in message
    else:
        assert warned == []  # O3's default loss scale is 1: nothing is lost
    assert _warnings(caplog) == []  # (scale_loss says nothing)


def test_a_plain_backward_under_o3_with_a_dynamic_scale_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        _train("O3", plain=True, loss_scale="dynamic")
    (message,) = _warnings(caplog)
    assert message.startswith("SGD.step() under O3 with float16: its grads were not produced inside")


def test_an_overflowing_plain_backward_under_o2_skips_the_step_as_a_static_scale_of_one_would():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (model(torch.randn(8, 6).half()).float().sum() * float("inf")).backward()
    opt.step()
    assert amp_patch.last_step_skipped(opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if "running" not in k
               and "num_batches" not in k)


def test_a_plain_backward_trains_under_remainder_masters_of_amp_patch_s_own_o2(caplog):
    """amp_patch's own O2 trains a plain backward too where it keeps half params and masters (remainder)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                      master_weights="remainder", verbosity=0)
    start = model[0].weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 6).bfloat16()).float().pow(2).mean().backward()
            opt.step()
    assert len(_warnings(caplog)) == 1
    assert not torch.equal(model[0].weight, start)
