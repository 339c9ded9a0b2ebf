"""Command-line runs show amp_patch's log lines (what Apex printed) unless the program configured logging."""
import logging

import pytest

from amp_patch.tools import cli

SCRIPT = """
import logging, sys, torch
from apex import amp
if "--configure" in sys.argv:
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="APP %(message)s")
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = amp.initialize(model, opt, opt_level="O1")
loss = model(torch.tensor([[float("inf"), 1.0]])).float().sum()
with amp.scale_loss(loss, opt) as scaled:
    scaled.backward()
opt.step()
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return str(path)


def _fresh_root_logger(monkeypatch):
    """The root logger as a fresh program has it: pytest's capture handler (added for the call) taken off."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def test_run_shows_configuration_and_overflow_lines(script, capsys, monkeypatch):
    _fresh_root_logger(monkeypatch)
    assert cli.main(["run", script]) == 0
    err = capsys.readouterr().err
    assert "amp_patch: opt_level O1" in err
    assert "Gradient overflow" in err and "loss scaler 0" in err
    assert logging.getLogger("amp_patch").handlers == [] and logging.getLogger("amp_patch").level == logging.NOTSET


def test_a_program_that_configures_logging_gets_the_lines_once(script, capsys, monkeypatch):
    _fresh_root_logger(monkeypatch)
    assert cli.main(["run", script, "--configure"]) == 0
    captured = capsys.readouterr()
    assert "Gradient overflow" not in captured.err
    assert captured.out.count("Gradient overflow: skipping step") == 1 and "APP opt_level O1" in captured.out
    # and Apex's own printed line, once (under the alias amp_patch prints what Apex printed)
    assert captured.out.count("Gradient overflow.  Skipping step, loss scaler 0") == 1


def test_a_default_logging_format_names_amp_patch_once(script, capsys, monkeypatch):
    """logging.basicConfig's default format already names the logger; the message does not repeat it."""
    _fresh_root_logger(monkeypatch)
    source = open(script).read().replace('format="APP %(message)s"', "")
    with open(script, "w") as f:
        f.write(source)
    assert cli.main(["run", script, "--configure"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "amp_patch" in line]
    assert any(line.startswith("INFO:amp_patch:opt_level O1") for line in lines), lines
    assert all(line.count("amp_patch") == 1 for line in lines), lines
