"""A plain ``loss.backward()`` under O1 float16 (scale_loss forgotten) trains without loss scaling: amp_patch says
so once per optimizer (O2/O3: tests/behaviour/test_apex_plain_backward_trains.py); with scale_loss, or with
bfloat16, nothing is said."""
import logging

import pytest
import torch
from torch import nn

import amp_patch


def _train(half_dtype, use_scale_loss, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O1", half_dtype=half_dtype, verbosity=0)
    try:
        for _ in range(steps):
            optimizer.zero_grad()
            loss = model(torch.randn(4, 4)).float().pow(2).mean()
            if use_scale_loss:
                with amp_patch.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
            else:
                loss.backward()
            optimizer.step()
    finally:
        amp_patch.deinitialize()


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "scale_loss" in r.getMessage()]


def test_a_plain_backward_under_o1_float16_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        _train(torch.float16, use_scale_loss=False)
    (message,) = _warnings(caplog)
    assert message.startswith("SGD.step() under O1 with float16: its grads were not produced inside "
                              "amp_patch.scale_loss()")
    assert "with amp_patch.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()" in message


@pytest.mark.parametrize("half_dtype, use_scale_loss", [(torch.float16, True), (torch.bfloat16, False)])
def test_scale_loss_or_bfloat16_says_nothing(half_dtype, use_scale_loss, caplog):
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        _train(half_dtype, use_scale_loss)
    assert _warnings(caplog) == []
