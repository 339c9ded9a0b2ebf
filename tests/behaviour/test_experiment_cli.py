"""A newcomer's `amp-patch experiment`: Ctrl-C, progress, the verdict, the PNG's panels and the
vocabulary (--opt-level, dtype shorthands), through cli.main or a subprocess."""
import argparse
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from tests_support import TESTS

import amp_patch
from amp_patch.tools import cli
from amp_patch.tools.experiment import plot
from amp_patch.tools.experiment.report import Progress, summarize
from amp_patch.tools.experiment.runner import Config, new_result
from amp_patch.tools.experiment.verdict import verdict

HERE = str(TESTS)
ROOT = os.path.dirname(HERE)
TINY = ["--job", "test_experiment:tiny_job", "--steps", "3", "--rounds", "1", "--no-isolate"]

SLOW_JOB = '''\
import os
import time

import torch
from torch import nn
from torch.nn import functional as F


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _data():
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0).long()


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.01)


def _loss(output, target):
    with open(os.environ["STEP_LOG"], "a") as f:  # one line per step: the test knows which rounds finished
        f.write(f"{os.getpid()}\\n")
    time.sleep(0.05)  # a slow step, so that Ctrl-C lands inside a round
    return F.cross_entropy(output.float(), target)


def job():
    return {"model_fn": _model, "optimizer_fn": _optimizer, "data_fn": _data, "loss_fn": _loss, "batch_size": 4,
            "name": "slow"}
'''


def _steps_logged(path):
    return path.read_text().split() if path.exists() else []


def _wait_for(condition, what, limit_s=300):
    """Poll ``condition`` (generous limit: a loaded machine starts processes slowly); fail saying what was awaited."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {limit_s} s waiting for {what} (the machine may be overloaded)")
        time.sleep(0.1)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to see the workers ended")
def test_ctrl_c_keeps_the_finished_rounds_says_interrupted_once_and_exits_130(tmp_path):
    """A path-style job, so the spawned variant processes load it by path too."""
    (tmp_path / "slow_jobs.py").write_text(SLOW_JOB)
    log = tmp_path / "steps.log"
    env = dict(os.environ, STEP_LOG=str(log), OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "amp_patch", "experiment", "--job", "./slow_jobs.py:job",
                             "--variants", "fp32,O1", "--steps", "40", "--out", "out"], cwd=str(tmp_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # 2 untimed steps and a first round of 8 per variant; one step more: round 1 finished for both variants
        _wait_for(lambda: len(_steps_logged(log)) >= 2 * 10 + 1, "the first round of both variants")
        workers = set(_steps_logged(log))
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and lines[0].startswith("amp-patch experiment: interrupted"), err
    assert "written to out/experiment.json (marked partial)" in lines[0]
    data = json.loads((tmp_path / "out" / "experiment.json").read_text())
    assert data["partial"] is True and data["jobs"]["slow"]["partial"] is True
    for v in data["jobs"]["slow"]["variants"].values():
        assert v["status"] == "interrupted" and len(v["rounds"]) >= 1 and v["steps_run"] >= 10, v
    assert "| O0 (fp32) | interrupted |" in out and "| O1 | interrupted |" in out and "(interrupted: partial" in out
    _wait_for(lambda: not any(_alive(int(pid)) for pid in workers), "the variant processes to end", 60)
    assert len(workers) == 2


def test_the_command_says_it_started_before_any_variant_runs(capsys, tmp_path):
    assert cli.main(["experiment"] + TINY + ["--variants", "fp32", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err.splitlines()
    starting = [line for line in err if line.startswith("starting ")]
    assert starting == ["starting 1 variant in this process (3 steps, bfloat16, cpu)..."], err
    assert "[" not in "".join(err)  # not a terminal: no progress bar


def test_progress_on_a_terminal_shows_elapsed_time_and_eta():
    now = [100.0]
    stream = io.StringIO()
    bar = Progress(2, 10, stream=stream, tty=True, clock=lambda: now[0])
    bar.announce("starting 2 variants in separate processes...")
    bar.start("mlp O1")
    now[0] += 20.0
    bar.step(1)  # 20 s of start-up (processes, models) before the first step: not a step's cost
    assert bar.line().endswith("5% mlp O1 1/10  0:20 elapsed, ETA ?"), bar.line()
    now[0] += 10.0
    bar.step(5)  # 4 steps in the 10 s since: 2.5 s a step, 15 steps to go
    assert bar.line().endswith("25% mlp O1 5/10  0:30 elapsed, ETA 0:38"), bar.line()
    assert stream.getvalue().startswith("starting 2 variants in separate processes...\n\r[")


def _variant(name, ratio, losses, low=None, high=None, status="ok"):
    v = new_result(name, True)
    low, high = low or ratio, high or ratio
    v.update(status=status, losses=losses, ratio_to_fp32=ratio, ratio_to_fp32_min=low, ratio_to_fp32_max=high,
             ratio_to_fp32_significant=None if ratio is None else name == "fp32" or not low <= 1.0 <= high)
    return v


def test_verdict_names_the_fastest_variant_within_tolerance_and_flags_a_loss_gap():
    fp32 = [4.0, 3.0, 2.0]
    variants = {"fp32": _variant("fp32", 1.0, fp32), "O1": _variant("O1", 0.8, [4.0, 3.01, 2.02], 0.7, 0.9),
                "O2": _variant("O2", 0.6, [4.0, 3.02, 2.05], 0.5, 0.7),
                "O3": _variant("O3", 0.4, [4.0, 3.2, 2.2], 0.3, 0.5),  # 10% off fp32 at the end: beyond 5%
                "native": _variant("native", None, [4.0], status="failed")}
    result = verdict(variants)
    assert result["fastest"] == "O2" and result["significant"] is True and list(result["beyond_tolerance"]) == ["O3"]
    assert result["text"].startswith("Verdict: O2 is the fastest variant whose loss stays within 5% of fp32's: "
                                     "0.60x fp32's step time (significant over the rounds)")
    assert "O3 loss gap 10% of fp32's loss exceeds 5%" in result["text"] and "native failed" in result["text"]
    assert verdict(variants, loss_tolerance=0.2)["fastest"] == "O3"
    variants["O2"] = _variant("O2", 0.6, [4.0, 3.02, 2.05], 0.5, 1.1)  # a round where O2 was slower: n.s.
    assert "not significant" in verdict(variants)["text"]
    assert "add it to --variants" in verdict({"O1": variants["O1"]})["text"]  # no fp32: no reference


def test_the_table_says_which_way_the_ratios_go_and_ends_with_the_verdict(capsys, tmp_path):
    assert cli.main(["experiment"] + TINY + ["--variants", "fp32,O1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.startswith("| variant |"))  # (under the heading's machine line)
    assert "| step time vs fp32 (<1 faster) | vs native (<1 faster) |" in header
    assert out[-1].startswith("**Verdict: ") and "within 5% of fp32's" in out[-1]
    data = json.loads((tmp_path / "experiment.json").read_text())
    assert data["jobs"]["tiny_job"]["verdict"]["text"] == out[-1].strip("*")


def test_png_panels_carry_information_and_show_the_verdict():
    Figure = pytest.importorskip("matplotlib.figure").Figure
    config = Config(steps=3, rounds=1)
    results = {n: _variant(n, 1.0, [1.0, 0.9]) for n in ("fp32", "O1", "native")}
    for v in results.values():
        v.update(loss_scales=[1.0, 1.0], rounds=[{"median_step_ms": 1.0}], median_step_ms=1.0, step_ms_min=1.0,
                 step_ms_max=1.0)
    report = summarize("j", config, results, True)
    assert plot.panels(report) == ["time", "memory", "loss gap"]  # bf16: no loss-scale panel
    subfig = Figure().subfigures(1, 1)
    plot.draw_row(subfig, report)
    assert report["verdict"]["text"] in subfig._suptitle.get_text().replace("\n", " ")
    results["O1"]["loss_scales"] = [65536.0, 32768.0]
    assert plot.panels(summarize("j", config, results, True)) == ["time", "memory", "loss gap", "loss scale"]


def test_opt_level_is_an_alias_of_variants(capsys, tmp_path):
    assert cli.main(["experiment"] + TINY + ["--opt-level", "O0", "O1", "--out", str(tmp_path)]) == 0
    assert list(json.loads((tmp_path / "experiment.json").read_text())["jobs"]["tiny_job"]["variants"]) == [
        "fp32", "O1"]


@pytest.mark.parametrize("given, canonical", [("fp16", "float16"), ("16", "float16"), ("16-mixed", "float16"),
                                              ("bf16", "bfloat16"), ("bf16-mixed", "bfloat16")])
def test_dtype_shorthands_on_the_command_line_echo_the_canonical_name(given, canonical, capsys, tmp_path):
    assert cli.main(["experiment"] + TINY + ["--variants", "O1", "--half-dtype", given, "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert f"amp-patch experiment: --half-dtype {given} is {canonical}" in captured.err.splitlines()
    assert f"### tiny_job: 3 steps, {canonical}, cpu" in captured.out


def test_dtype_shorthands_in_python():
    for given, dtype in (("fp16", torch.float16), ("bf16-mixed", torch.bfloat16), ("16", torch.float16),
                         (16, torch.float16), ("BF16", torch.bfloat16), (torch.bfloat16, torch.bfloat16)):
        model = amp_patch.initialize(torch.nn.Linear(2, 2), opt_level="O1", half_dtype=given, verbosity=0)
        try:
            assert amp_patch.session.state.current().props.half_dtype is dtype, given
        finally:
            amp_patch.deinitialize()
        assert model is not None
    with pytest.raises(amp_patch.ConfigError, match=r"half_dtype='fp32'; allowed: torch.float16, torch.bfloat16 "
                                                    r"\(or by name: 'float16', 'fp16'"):
        amp_patch.initialize(torch.nn.Linear(2, 2), opt_level="O1", half_dtype="fp32")
    with pytest.raises(amp_patch.ConfigError, match="half_dtype=True"):
        amp_patch.initialize(torch.nn.Linear(2, 2), opt_level="O1", half_dtype=True)


def test_every_command_error_starts_with_its_name_and_error(capsys):
    for argv in (["trace", "--model", "resnet"], ["trace", "--half-dtype", "fp8"],
                 ["experiment", "--half-dtype", "int8"], ["doctor", "--job", "x:y", "--half-dtype", "fp32"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"amp-patch {argv[0]}: error: "), (argv, err)
    assert cli.main(["trace", "--half-dtype", "fp8"]) == 2
    assert "argument --half-dtype: 'fp8'; allowed: torch.float16, torch.bfloat16" in capsys.readouterr().err


def test_the_missing_matplotlib_notice_is_printed_whole(capsys, tmp_path, monkeypatch):
    from amp_patch.tools.experiment import command
    monkeypatch.setattr(command, "_has_matplotlib", lambda: False)
    assert cli.main(["experiment"] + TINY + ["--variants", "fp32", "--out", str(tmp_path)]) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert first == (f"amp-patch experiment: no experiment.png will be written to {tmp_path}: matplotlib is not "
                     "installed (pip install matplotlib); the table and the JSON are written as usual")


_CALLS = []


def _interrupting_loss(output, target):
    _CALLS.append(1)
    if len(_CALLS) == 6:  # O1's first step (in process, fp32 ran its 5 steps before)
        raise KeyboardInterrupt
    return torch.nn.functional.cross_entropy(output, target)


def test_ctrl_c_in_process_undoes_the_session_and_keeps_what_finished(tmp_path):
    from test_experiment import tiny_data, tiny_model, tiny_optimizer

    from amp_patch.errors import ExperimentInterrupted
    _CALLS.clear()
    with pytest.raises(ExperimentInterrupted) as stopped:
        amp_patch.tools.experiment.compare(tiny_model, tiny_optimizer, tiny_data, _interrupting_loss,
                                           variants="fp32,O1", steps=5, rounds=3, batch_size=8, isolate=False,
                                           progress=False, out_dir=tmp_path)
    assert amp_patch.session.state.current() is None  # O1's session was undone (the autouse fixture checks the patches)
    (report,) = stopped.value.reports
    fp32, o1 = report["variants"]["fp32"], report["variants"]["O1"]
    assert report["partial"] is True and fp32["status"] == "ok" and len(fp32["rounds"]) == 3
    assert o1["status"] == "interrupted" and o1["steps_run"] == 0
    data = json.loads((tmp_path / "experiment.json").read_text())
    assert data["partial"] is True and data["jobs"]["job"]["variants"]["fp32"]["steps_run"] == 5


def test_ctrl_c_after_a_variant_ran_all_its_rounds_leaves_it_ok(tmp_path, monkeypatch):
    """Isolated: Ctrl-C while the variants close, after every round ran. fp32 had closed (its result in hand),
    O1 had not: both finished all their rounds, so neither is marked interrupted (robustness item 5)."""
    from test_experiment import tiny_data, tiny_loss, tiny_model, tiny_optimizer

    from amp_patch.errors import ExperimentInterrupted
    from amp_patch.tools.experiment import isolation
    close = isolation.IsolatedRun.close

    def close_or_ctrl_c(self):
        if self.variant == "O1":
            raise KeyboardInterrupt
        return close(self)

    monkeypatch.setattr(isolation.IsolatedRun, "close", close_or_ctrl_c)
    with pytest.raises(ExperimentInterrupted) as stopped:
        amp_patch.tools.experiment.compare(tiny_model, tiny_optimizer, tiny_data, tiny_loss, variants="fp32,O1",
                                           steps=4, rounds=2, batch_size=8, isolate=True, progress=False,
                                           out_dir=tmp_path)
    (report,) = stopped.value.reports
    for name, v in report["variants"].items():
        assert v["status"] == "ok" and len(v["rounds"]) == 2 and v["steps_run"] == 4, (name, v["error"])


def _report(rounds, *variants):
    """A report of ``rounds`` planned rounds; ``variants``: (name, status, finished rounds)."""
    return {"rounds": rounds, "variants": {name: {"status": status, "rounds": [{}] * done}
                                           for name, status, done in variants}}


@pytest.mark.parametrize("reports, expected", [
    ([_report(5, ("fp32", "ok", 5), ("O1", "interrupted", 4), ("O2", "interrupted", 4))],
     "; 1 of 3 variant run(s) finished all their rounds, the others stopped after 4/5, 4/5 round(s); written to "
     "out/experiment.json (marked partial)"),
    ([_report(5, ("fp32", "ok", 5), ("O1", "ok", 5))],
     "; all 2 variant run(s) had finished their rounds; written to out/experiment.json"),  # nothing missing
    ([_report(5, ("fp32", "interrupted", 0))], "; no round had finished"),
    ([], "; no round had finished"),
])
def test_the_ctrl_c_line_counts_rounds_as_rounds_not_variant_rounds(reports, expected):
    from amp_patch.tools.experiment import command
    assert command._kept(argparse.Namespace(out="out"), reports) == expected


def test_ctrl_c_in_any_command_is_one_line_and_exit_130(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run_validate", interrupted)
    assert cli.main(["validate", "apex"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["amp-patch validate: interrupted (Ctrl-C)"]


@pytest.mark.parametrize("command", ["experiment", "trace", "doctor", "validate", "lists", "run"])
def test_every_subcommands_help_prints(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: amp-patch {command}")
