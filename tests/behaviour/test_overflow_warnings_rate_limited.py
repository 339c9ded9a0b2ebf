"""diagnose_overflow=True: a run of overflowing steps logs one WARNING per interval, like the scaler's own line;
the next line counts the ones left out, and the history keeps every overflow."""
import logging

import torch
from torch import nn

import amp_patch
from amp_patch.observe.overflow import OverflowDiagnoser


class Overflows(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x) * 1e6  # beyond float16's range once cast


def _overflow_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("overflow (loss")]


def test_twelve_overflowing_steps_log_one_diagnosis(caplog, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(OverflowDiagnoser, "clock", staticmethod(lambda: now[0]), raising=False)
    model = Overflows()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O1", half_dtype=torch.float16,
                                            diagnose_overflow=True, verbosity=0)
    try:
        with caplog.at_level(logging.WARNING, logger="amp_patch"):
            for step in range(13):
                now[0] = step * 0.01 if step < 12 else 11.0  # 12 steps in 0.12 s, then one after the interval
                optimizer.zero_grad()
                with amp_patch.scale_loss(model(torch.randn(2, 4)).float().sum(), optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
            records = [r for r in amp_patch.history() if r.get("overflow")]
    finally:
        amp_patch.deinitialize()
    lines = _overflow_lines(caplog)
    assert len(lines) == 2, lines
    assert "(11 similar message(s) suppressed in the last 11.0 s" in lines[1]
    assert len(records) == 13
