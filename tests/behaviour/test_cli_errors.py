"""A newcomer's first mistakes on the command line: one line on stderr and exit status 2, no traceback; quiet
when the reader of stdout goes away."""
import os
import subprocess
import sys

import pytest
import torch
from tests_support import REPO, run_killing_group

from amp_patch.tools import cli

ROOT = str(REPO)


def _one_line_error(capsys, code, expect):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expect in err[0], err
    assert err[0].startswith("amp-patch ")


def test_run_missing_script(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _one_line_error(capsys, cli.main(["run", "nosuch.py"]), "no such script: 'nosuch.py'")


def test_run_missing_module(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _one_line_error(capsys, cli.main(["run", "-m", "nosuch_pkg_xyz.train"]), "no module named 'nosuch_pkg_xyz.train'")


def test_run_module_from_the_current_directory(capsys, tmp_path, monkeypatch):
    (tmp_path / "newcomer_train_mod.py").write_text("import sys\nprint('ran', sys.argv[1:])\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert cli.main(["run", "-m", "newcomer_train_mod", "--x"]) == 0
    sys.modules.pop("newcomer_train_mod", None)
    assert "ran ['--x']" in capsys.readouterr().out


def test_run_refuses_a_real_apex_amp_in_one_line(capsys, tmp_path, monkeypatch):
    (tmp_path / "apex" / "amp").mkdir(parents=True)
    (tmp_path / "apex" / "__init__.py").write_text("")
    (tmp_path / "apex" / "amp" / "__init__.py").write_text("")
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _one_line_error(capsys, cli.main(["run", str(tmp_path / "train.py")]), "a real apex.amp is installed")
    assert "apex" not in sys.modules


def test_trace_bad_model_and_experiment_bad_job(capsys):
    _one_line_error(capsys, cli.main(["trace", "--model", "resnet"]), "--model 'resnet'")
    _one_line_error(capsys, cli.main(["experiment", "--job", "nosuch_xyz:job", "--no-progress"]), "cannot import")


def test_closed_pipe_is_quiet(tmp_path):
    """`amp-patch lists | head -0`: the reader is gone before the output is written."""
    proc = subprocess.Popen([sys.executable, "-m", "amp_patch", "lists"], cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT})
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and err == "", err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_benchmark_without_cuda_is_one_line(tmp_path):
    proc = run_killing_group([sys.executable, os.path.join(ROOT, "benchmarks", "bench_step_time.py"), "--device",
                              "cuda"], tmp_path, {**os.environ, "PYTHONPATH": ROOT}, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "torch.cuda.is_available() is False" in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr
