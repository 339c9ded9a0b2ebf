"""Under Apex's API amp_patch prints Apex's lines as Apex printed them (stdout, Apex's rank rule); its own API
keeps logging, and its records format under a root-logger format naming ``%(rank)s`` (NVIDIA GNMT's)."""
import logging

import pytest
import torch

import amp_patch
from amp_patch import legacy
from amp_patch._torch import dist as ddp

# Apex e13873de, apex/amp/frontend.py: what `amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32="False",
# loss_scale="128")` printed.
APEX_O2_LINES = """Selected optimization level O2:  FP16 training with FP32 batchnorm and FP32 master weights.

Defaults for this optimization level are:
enabled                : True
opt_level              : O2
cast_model_type        : torch.float16
patch_torch_functions  : False
keep_batchnorm_fp32    : True
master_weights         : True
loss_scale             : dynamic
Processing user overrides (additional kwargs that are not None)...
After processing overrides, optimization options are:
enabled                : True
opt_level              : O2
cast_model_type        : torch.float16
patch_torch_functions  : False
keep_batchnorm_fp32    : False
master_weights         : True
loss_scale             : 128.0
"""
OVERFLOW_LINE = "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0\n"  # handle.py


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _iteration(model, optimizer, scale_loss, bad):
    loss = model(torch.ones(2, 3)).float().sum() * (float("inf") if bad else 1e-3)
    with scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_initialize_prints_apexs_lines(capsys):
    try:
        legacy.amp.initialize(*_tiny(), opt_level="O2", keep_batchnorm_fp32="False", loss_scale="128")
        assert capsys.readouterr().out == APEX_O2_LINES
    finally:
        amp_patch.deinitialize()


def test_a_skipped_step_prints_apexs_overflow_line(capsys):
    model, optimizer = legacy.amp.initialize(*_tiny(), opt_level="O1", verbosity=1)
    try:
        capsys.readouterr()
        _iteration(model, optimizer, legacy.amp.scale_loss, bad=True)
        _iteration(model, optimizer, legacy.amp.scale_loss, bad=False)
        assert capsys.readouterr().out == OVERFLOW_LINE
    finally:
        amp_patch.deinitialize()


def test_verbosity_0_and_amp_patchs_own_api_print_nothing(capsys):
    for init, scale_loss in ((lambda: legacy.amp.initialize(*_tiny(), opt_level="O1", verbosity=0),
                              legacy.amp.scale_loss),
                             (lambda: amp_patch.initialize(*_tiny(), opt_level="O1"), amp_patch.scale_loss)):
        model, optimizer = init()
        try:
            _iteration(model, optimizer, scale_loss, bad=True)
        finally:
            amp_patch.deinitialize()
    assert capsys.readouterr().out == ""


def test_apexs_rank_rule(capsys, monkeypatch):
    """Rank 1 of 2: no initialize lines (Apex printed them on rank 0), the overflow line still (every rank)."""
    monkeypatch.setattr(ddp, "world_size", lambda: 2)
    monkeypatch.setattr(ddp, "rank", lambda: 1)
    monkeypatch.setattr(ddp, "agree_overflow", lambda found: found)
    model, optimizer = legacy.amp.initialize(*_tiny(), opt_level="O1")
    try:
        _iteration(model, optimizer, legacy.amp.scale_loss, bad=True)
    finally:
        amp_patch.deinitialize()
    assert capsys.readouterr().out == OVERFLOW_LINE


class _GnmtRankFilter(logging.Filter):
    def filter(self, record):
        record.rank = 0
        return True


@pytest.fixture
def gnmt_logging():
    """NVIDIA GNMT's setup_logging: a root handler formatting ``%(rank)s``, the rank set by a root *logger*
    filter (which records propagated from other loggers never pass)."""
    root, stream = logging.getLogger(), _Stream()
    handler, flt = logging.StreamHandler(stream), _GnmtRankFilter()
    handler.setFormatter(logging.Formatter("%(levelname)s - %(rank)s - %(message)s"))
    level = root.level
    root.addHandler(handler)
    root.addFilter(flt)
    root.setLevel(logging.DEBUG)
    yield stream
    root.removeHandler(handler)
    root.removeFilter(flt)
    root.setLevel(level)


class _Stream(list):
    def write(self, text):
        self.append(text)

    def flush(self):
        pass


def test_amp_patch_records_format_under_gnmts_rank_format(gnmt_logging, capsys):
    model, optimizer = legacy.amp.initialize(*_tiny(), opt_level="O1", verbosity=0)
    try:
        _iteration(model, optimizer, legacy.amp.scale_loss, bad=True)
    finally:
        amp_patch.deinitialize()
    text = "".join(gnmt_logging)
    assert "INFO - 0 - Gradient overflow: skipping step" in text, text
    assert "Logging error" not in capsys.readouterr().err
