"""What the experiment's report says about itself: every job keeps its own table and JSON entry (titles never
collide), the step-time note says why rounds are missing, and the verdict's loss gap has one definition."""
import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from test_experiment import tiny_data, tiny_loss, tiny_model

from amp_patch.tools.experiment import Job, add_parser, command, run_experiment
from amp_patch.tools.experiment import verdict as verdict_module
from amp_patch.tools.experiment.report import markdown, summarize
from amp_patch.tools.experiment.runner import Config, new_result
from amp_patch.tools.experiment.verdict import loss_gap, verdict

ROOT = Path(__file__).resolve().parents[2]

UNNAMED_JOBS = '''\
import torch
from test_experiment import tiny_data, tiny_loss, tiny_model

from amp_patch.tools.experiment import Job


def _slow_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.001)


def _fast_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5)


def noname_a():
    return Job(tiny_model, _slow_sgd, tiny_data, tiny_loss, batch_size=8)


def noname_b():
    return Job(tiny_model, _fast_sgd, tiny_data, tiny_loss, batch_size=8)
'''


def _cli(argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["experiment", "--no-progress", *argv])
    return args.func(args)


def _job(lr, **kw):
    return Job(tiny_model, _Sgd(lr), tiny_data, tiny_loss, batch_size=8, **kw)


class _Sgd:
    """An optimizer_fn with its own learning rate (in-process runs need not pickle it)."""

    def __init__(self, lr):
        self.lr = lr

    def __call__(self, model):
        return torch.optim.SGD(model.parameters(), lr=self.lr)


def test_two_unnamed_jobs_on_the_command_line_get_a_table_and_a_json_entry_each(tmp_path, monkeypatch, capsys):
    (tmp_path / "unnamed_jobs.py").write_text(UNNAMED_JOBS)
    monkeypatch.setattr(command, "_has_matplotlib", lambda: False)
    spec = str(tmp_path / "unnamed_jobs.py")
    code = _cli(["--job", f"{spec}:noname_a", "--job", f"{spec}:noname_b", "--variants", "O0", "--steps", "4",
                 "--rounds", "1", "--no-isolate", "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    sys.modules.pop("unnamed_jobs", None)
    assert code == 0, captured.err
    assert "### noname_a: 4 steps" in captured.out and "### noname_b: 4 steps" in captured.out, captured.out
    jobs = json.loads((tmp_path / "out" / "experiment.json").read_text())["jobs"]
    assert sorted(jobs) == ["noname_a", "noname_b"]
    assert jobs["noname_a"]["variants"]["fp32"]["losses"] != jobs["noname_b"]["variants"]["fp32"]["losses"]


def test_jobs_whose_names_collide_are_told_apart_not_dropped(tmp_path):
    reports = run_experiment([_job(0.001), _job(0.5), _job(0.1, name="mine"), _job(0.2, name="mine")],
                             variants="fp32", steps=4, rounds=1, isolate=False, progress=False, out_dir=tmp_path)
    titles = [r["job"] for r in reports]
    assert titles == ["job (#1)", "job (#2)", "mine (#3)", "mine (#4)"]
    jobs = json.loads((tmp_path / "experiment.json").read_text())["jobs"]
    assert list(jobs) == titles
    losses = [tuple(jobs[t]["variants"]["fp32"]["losses"]) for t in titles]
    assert len(set(losses)) == 4  # each entry holds its own job's numbers


def test_a_job_spec_run_twice_gets_two_entries(tmp_path):
    spec = "test_experiment:tiny_job"
    reports = run_experiment([spec, spec], variants="fp32", steps=3, rounds=1, isolate=False, progress=False,
                             out_dir=tmp_path)
    assert [r["job"] for r in reports] == [f"tiny_job ({spec}, #1)", f"tiny_job ({spec}, #2)"]
    assert len(json.loads((tmp_path / "experiment.json").read_text())["jobs"]) == 2


def _failed(variant, rounds=0, status="failed"):
    result = new_result(variant, isolated=False)
    result.update(status=status, error="RuntimeError: no", losses=[1.0] * rounds)
    result["rounds"] = [{"round": i, "first_step": 2 + i, "step_times_ms": [1.0], "median_step_ms": 1.0,
                         "peak_memory_mib": None} for i in range(rounds)]
    if rounds:
        result.update(median_step_ms=1.0, step_ms_min=1.0, step_ms_max=1.0)
    return result


def _ok(variant):
    return _failed(variant, rounds=3, status="ok") | {"error": None}


def test_when_every_variant_fails_the_note_says_so_and_blames_no_ctrl_c():
    config = Config(steps=5, rounds=3)
    report = summarize("job", config, {"fp32": _failed("fp32"), "O2": _failed("O2")}, isolated=True)
    text = markdown(report)
    assert "Ctrl-C" not in text
    assert "no variant timed a round" in text


def test_a_variant_that_stops_early_is_named_in_the_note_not_ctrl_c():
    config = Config(steps=5, rounds=3)
    report = summarize("job", config, {"fp32": _ok("fp32"), "O3": _failed("O3", rounds=1, status="diverged")},
                       isolated=True)
    text = markdown(report)
    assert "median over 1-3 rounds (of 3 planned: O3 diverged)" in text
    assert "Ctrl-C" not in text


def test_ctrl_c_is_named_only_when_the_run_was_interrupted():
    config = Config(steps=5, rounds=3)
    report = summarize("job", config, {"fp32": _ok("fp32"), "O1": _failed("O1", rounds=2, status="interrupted")},
                       isolated=True)
    report["partial"] = True
    assert "median over 2-3 rounds (of 3 planned: Ctrl-C stopped the rest)" in markdown(report)
    report = summarize("job", config, {"fp32": _failed("fp32", status="interrupted")}, isolated=True)
    report["partial"] = True
    assert "Ctrl-C stopped the experiment before any variant timed a round" in markdown(report)


def _losses(values, status="ok"):
    return {"status": status, "losses": list(values)}


@pytest.mark.parametrize("mine, base, gap", [
    ([2.0005, 1.0], [2.0, 1.0], 0.0),  # 0.0005 apart: within the 0.001 absolute slack
    ([2.003, 1.0], [2.0, 1.0], (0.003 - 0.001) / 2.0),  # the slack comes off, the rest is relative to fp32's
    ([0.0015, 1.0], [0.0, 1.0], (0.0015 - 0.001) / 0.001),  # fp32's loss near 0: relative to the slack
    ([1.0, "nan"], [1.0, 1.0], float("inf")),  # a non-finite loss
])
def test_loss_gap_is_the_largest_gap_beyond_the_absolute_slack_relative_to_fp32s_loss(mine, base, gap):
    assert loss_gap(_losses(mine), _losses(base)) == pytest.approx(gap)
    variants = {"fp32": _losses(base) | {"ratio_to_fp32": None}, "O1": _losses(mine) | {"ratio_to_fp32": None}}
    assert verdict(variants)["loss_gaps"]["O1"] == pytest.approx(gap)


def test_the_api_reference_gives_the_loss_gaps_definition_the_code_computes():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    slack = f"{verdict_module._ABS_SLACK:g}"
    assert f"`max(0, |loss - fp32 loss| - {slack}) / max(|fp32 loss|, {slack})`" in " ".join(text.split())
