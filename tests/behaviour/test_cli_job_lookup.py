"""One job lookup for every command: ``module:function`` from the current directory first,
``path/to/file.py:function``, and a job that raises gets one line naming the job, the exception and the user's
file:line, exit 2 (the traceback with --verbose). Through ``cli.main``, with the current directory off sys.path
(as under the installed ``amp-patch`` script)."""
import sys

import pytest

from amp_patch.tools import cli

JOBS = '''\
import torch
from torch import nn
from torch.nn import functional as F


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _data():
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0).long()


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.01)


def _loss(output, target):
    return F.cross_entropy(output.float(), target)


def make_job():
    return {"model_fn": _model, "optimizer_fn": _optimizer, "data_fn": _data, "loss_fn": _loss, "batch_size": 4,
            "name": "cwd_job"}


def _read_data_dir():
    raise FileNotFoundError("no such data directory: ./data")


def broken_job():
    return _read_data_dir()
'''
RAISE_LINE = JOBS.splitlines().index('    raise FileNotFoundError("no such data directory: ./data")') + 1

# each command with the arguments that make it cheap (the experiment in-process, one variant, three steps: the
# first two are untimed, and a run that times none is refused)
COMMANDS = {
    "experiment": ["--variants", "fp32", "--steps", "3", "--rounds", "1", "--no-isolate", "--no-progress",
                   "--out", "out"],
    "trace": [],
    "doctor": ["--steps", "2"],
    "validate": ["apex", "--quiet"],
}


@pytest.fixture
def jobs_dir(tmp_path, monkeypatch):
    """tmp_path holds newcomer_jobs_mod.py and is the current directory, but not on sys.path."""
    (tmp_path / "newcomer_jobs_mod.py").write_text(JOBS)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "path_jobs.py").write_text(JOBS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    for name in ("newcomer_jobs_mod", "path_jobs"):
        sys.modules.pop(name, None)


def _main(command, job, *extra):
    argv = [command] + (COMMANDS[command][:1] if command == "validate" else []) + ["--job", job]
    return cli.main(argv + (COMMANDS[command][1:] if command == "validate" else COMMANDS[command]) + list(extra))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_module_in_the_current_directory_is_found_by_every_command(command, jobs_dir, capsys):
    status = _main(command, "newcomer_jobs_mod:make_job")
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "Traceback" not in captured.err and "error" not in captured.err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_path_style_job_is_found_by_every_command(command, jobs_dir, capsys):
    status = _main(command, "sub/path_jobs.py:make_job")
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "Traceback" not in captured.err and "error" not in captured.err


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("job", ["newcomer_jobs_mod:broken_job", "./sub/path_jobs.py:broken_job"])
def test_a_raising_job_is_one_line_naming_the_job_the_exception_and_its_line(command, job, jobs_dir, capsys):
    status = _main(command, job)
    err = capsys.readouterr().err.splitlines()
    where = "newcomer_jobs_mod.py" if ":broken" in job and "/" not in job else "sub/path_jobs.py"
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"amp-patch {command}: error: --job {job!r} raised FileNotFoundError: no such data "
                             f"directory: ./data"), err
    assert f"at {where}:{RAISE_LINE}" in err[0], err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_path_style_job_imports_its_neighbours_as_python_file_py_does(command, jobs_dir, capsys):
    (jobs_dir / "sub" / "mytrain.py").write_text(JOBS.replace('"cwd_job"', '"neighbour_job"'))
    (jobs_dir / "sub" / "entry.py").write_text("from mytrain import make_job  # noqa: F401\n")
    try:
        status = _main(command, "sub/entry.py:make_job")
        captured = capsys.readouterr()
        assert status == 0, captured.err
        assert "ModuleNotFoundError" not in captured.err
    finally:
        for name in ("mytrain", "entry"):
            sys.modules.pop(name, None)


def test_verbose_adds_the_full_traceback(jobs_dir, capsys):
    assert _main("doctor", "newcomer_jobs_mod:broken_job", "--verbose") == 2
    err = capsys.readouterr().err
    assert err.startswith("amp-patch doctor: error: --job 'newcomer_jobs_mod:broken_job' raised")
    assert "Traceback (most recent call last)" in err and f'newcomer_jobs_mod.py", line {RAISE_LINE}' in err


def test_a_job_whose_model_raises_later_names_the_users_line(jobs_dir, capsys):
    """The job function returns, but its model_fn raises when the command runs it (doctor, trace)."""
    (jobs_dir / "late_mod.py").write_text(JOBS.replace('    return nn.Sequential(nn.Linear(4, 4)',
                                                       '    raise RuntimeError("cuda only")\n    return nn.Sequential('
                                                       'nn.Linear(4, 4)'))
    try:
        for command in ("doctor", "trace", "validate"):
            assert _main(command, "late_mod:make_job") == 2
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and err[0].startswith(f"amp-patch {command}: error: --job 'late_mod:make_job' "
                                                       "raised RuntimeError: cuda only"), err
            assert "at late_mod.py:7;" in err[0], err  # the raise inside _model
    finally:
        sys.modules.pop("late_mod", None)


def test_a_missing_module_or_file_says_how_to_pass_a_job(jobs_dir, capsys):
    assert _main("doctor", "no_such_jobs_xyz:make_job") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "cannot import 'no_such_jobs_xyz'" in err[0] and "path/to/file.py:function" in err[0]
    assert _main("trace", "sub/missing.py:make_job") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no such file: 'sub/missing.py'" in err[0], err


def test_a_job_calling_sys_exit_is_a_job_error_not_a_silent_exit(jobs_dir, capsys):
    """``sys.exit(3)`` in the job function (or at the job file's import) is the user's code raising: exit 2 and
    one line naming it, not exit 3 with nothing said (robustness item 3)."""
    (jobs_dir / "exiting_mod.py").write_text(JOBS + "\n\ndef exits():\n    raise SystemExit(3)\n")
    (jobs_dir / "exit_at_import.py").write_text("import sys\nsys.exit(4)\n")
    try:
        for job, line in (("exiting_mod:exits", "exiting_mod.py:"), ("exit_at_import.py:make_job",
                                                                      "exit_at_import.py:2")):
            assert _main("trace", job) == 2
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and err[0].startswith(f"amp-patch trace: error: --job {job!r} raised SystemExit"), err
            assert line in err[0], err
    finally:
        for name in ("exiting_mod", "exit_at_import"):
            sys.modules.pop(name, None)
