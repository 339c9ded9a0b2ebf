"""amp-patch experiment as a newcomer reads it: interleaved rounds with their spread, a valid markdown table, the
time limit, the job's own name, variant names as strict as initialize's, and the PNG's content choices."""
import argparse
import json
import sys
import time

import pytest
import torch
from test_experiment import tiny_data, tiny_loss, tiny_model, tiny_optimizer
from torch import nn

import amp_patch
from amp_patch.tools.experiment import add_parser, api, command, compare, plot
from amp_patch.tools.experiment.report import dynamic_scale_variants, summarize
from amp_patch.tools.experiment.runner import Config, VariantRun, new_result


def named_job():
    return {"model_fn": tiny_model, "optimizer_fn": tiny_optimizer, "data_fn": tiny_data, "loss_fn": tiny_loss,
            "batch_size": 8, "name": "my_named_job"}


class Hangs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, x):
        time.sleep(3600)


class SpikesOnce(nn.Module):
    """Its 4th forward (step 3: the second timed round of Config(steps=6, rounds=4)) touches 96 MiB more."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 4:
            x = x + torch.ones(24 * 2 ** 20)[:1] * 0  # written, so resident; freed (unmapped) right after
        return self.lin(x)


def _cli(argv):
    parser = argparse.ArgumentParser(prog="amp-patch")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["experiment"] + argv)
    return args.func(args)


def _cells(row):
    """Cells of a markdown table row, split on the pipes that are not escaped."""
    out, cell, escaped = [], "", False
    for ch in row.strip().strip("|"):
        if ch == "|" and not escaped:
            out.append(cell)
            cell = ""
        else:
            cell += ch
        escaped = ch == "\\"
    return out + [cell]


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("exp")
    report = compare(tiny_model, tiny_optimizer, tiny_data, tiny_loss, variants=("fp32", "O1"), steps=8, rounds=3,
                     batch_size=8, isolate=False, progress=False, out_dir=out)
    return report, json.loads((out / "experiment.json").read_text())


def test_markdown_table_is_valid_and_labels_o0(in_process):
    report, _ = in_process
    text = api.format_reports([report])
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert len(rows) == 4 and all(len(_cells(r)) == len(_cells(rows[0])) for r in rows), rows
    assert rows[2].startswith("| O0 (fp32) | ok |") and rows[3].startswith("| O1 | ok |")
    # the default half dtype is explained once, in the README, not in every table
    assert "Half dtype" not in text and "initialize() defaults to float16" not in text


def test_json_keeps_every_round(in_process):
    report, data = in_process
    o1 = data["jobs"]["job"]["variants"]["O1"]
    assert report["rounds"] == 3 and [r["round"] for r in o1["rounds"]] == [0, 1, 2]
    assert [r["first_step"] for r in o1["rounds"]] == [2, 4, 6]  # steps 0-1: warm-up and cast count, untimed
    assert sum(len(r["step_times_ms"]) for r in o1["rounds"]) == 6 == len(o1["step_times_ms"])
    assert o1["step_ms_min"] <= o1["median_step_ms"] <= o1["step_ms_max"]


def _fake(variant, medians):
    result = new_result(variant, True)
    result["rounds"] = [{"round": i, "median_step_ms": m} for i, m in enumerate(medians)]
    result["median_step_ms"] = sorted(medians)[len(medians) // 2]
    result["step_ms_min"], result["step_ms_max"] = min(medians), max(medians)
    return result


def test_ratio_is_taken_round_by_round_and_marked_when_not_significant():
    config = Config(steps=5, rounds=3)
    results = {"fp32": _fake("fp32", [1.0, 2.0, 1.0]), "O1": _fake("O1", [1.2, 2.2, 0.9]),
               "O2": _fake("O2", [2.0, 4.0, 2.0])}
    report = summarize("j", config, results, True)
    o1, o2 = report["variants"]["O1"], report["variants"]["O2"]
    assert o1["ratio_to_fp32"] == pytest.approx(1.1) and o1["ratio_to_fp32_min"] == pytest.approx(0.9)
    assert o1["ratio_to_fp32_significant"] is False and o2["ratio_to_fp32_significant"] is True
    # machine noise that hits a whole round (round 1 twice as slow) does not widen O2's ratio: 2.00x flat
    assert o2["ratio_to_fp32_min"] == o2["ratio_to_fp32_max"] == 2.0
    text = api.format_reports([report])
    assert "| O1 | ok | 1.200 (0.900-2.200) | 1.10x (0.90-1.20) n.s. |" in text
    assert "| O2 | ok | 2.000 (2.000-4.000) | 2.00x |" in text


class _Recorder:
    def __init__(self, log, variant):
        self.log, self.variant = log, variant

    def setup(self):
        self.log.append(("setup", self.variant))

    def run_round(self, size):
        self.log.append(("round", self.variant, size))

    def close(self):
        self.log.append(("close", self.variant))
        return new_result(self.variant, True)


def test_each_round_runs_every_variant_in_turn():
    log = []
    group = [(v, _Recorder(log, v)) for v in ("fp32", "O1")]
    api._run_group(group, "j", Config(steps=6, rounds=2), api.Progress(2, 6, enabled=False))
    assert log == [("setup", "fp32"), ("setup", "O1"), ("round", "fp32", 2), ("round", "O1", 2),
                   ("round", "fp32", 2), ("round", "O1", 2), ("close", "fp32"), ("close", "O1")]


def test_a_hung_variant_is_killed_and_reported_as_timeout():
    start = time.monotonic()
    report = compare(Hangs, tiny_optimizer, tiny_data, tiny_loss, variants=("O1",), steps=3, batch_size=8,
                     progress=False, timeout_s=4)
    o1 = report["variants"]["O1"]
    assert o1["status"] == "timeout" and "time limit of 4 s" in o1["error"]
    # (not the variant's default 600 s limit: a generous bound, since starting the process is slow under load)
    assert time.monotonic() - start < 300, "the hung variant was not killed at its 4 s limit"


def test_job_name_is_honoured_and_job_module_found_in_cwd(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "newcomer_jobs_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "jobs.py").write_text("from test_experiment_rounds import named_job as make_job\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.setattr(command, "_has_matplotlib", lambda: False)
    code = _cli(["--job", "newcomer_jobs_pkg.jobs:make_job", "--variants", "O0", "--steps", "3", "--no-isolate",
                 "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    sys.modules.pop("newcomer_jobs_pkg.jobs", None), sys.modules.pop("newcomer_jobs_pkg", None)
    assert code == 0, captured.err
    assert "### my_named_job: 3 steps" in captured.out
    first = captured.err.splitlines()[0]  # the missing PNG is announced before anything runs
    assert first.startswith("amp-patch experiment: no experiment.png will be written"), captured.err


@pytest.mark.parametrize("name, hint", [("o1", "use 'O1'"), ("FP32", "use 'fp32'"), ("O4", "allowed")])
def test_variant_names_are_as_strict_as_opt_levels(name, hint, capsys):
    with pytest.raises(amp_patch.ConfigError, match=hint):
        compare(tiny_model, tiny_optimizer, tiny_data, tiny_loss, variants=name, isolate=False, progress=False)
    assert _cli(["--variants", name, "--model", "mlp", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and hint in err[0]
    with pytest.raises(amp_patch.ConfigError, match="case-sensitive" if name == "o1" else "allowed"):
        amp_patch.initialize(tiny_model(), opt_level=name)


def test_png_draws_the_loss_scale_only_where_it_is_dynamic():
    report = {"variants": {"fp32": {"loss_scales": [1.0, 1.0]}, "O1": {"loss_scales": [65536.0, 32768.0]},
                           "native": {"loss_scales": [1.0, 1.0]}, "O2": {"loss_scales": [65536.0, 65536.0]}}}
    assert dynamic_scale_variants(report) == ["O1", "O2"]


def _memory_run(isolated):
    job = {"model_fn": SpikesOnce, "optimizer_fn": tiny_optimizer, "data_fn": tiny_data, "loss_fn": tiny_loss,
           "batch_size": 8}
    config = Config(steps=6, rounds=4)
    run = VariantRun(job, "fp32", config, isolated=isolated)
    run.setup()
    for size in config.round_sizes():
        run.run_round(size)
    return run.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-round CPU peaks need Linux's clear_refs")
def test_peak_memory_is_measured_per_round_in_the_variants_own_process():
    # (isolated=True as in a variant's process: this resets pytest's own peak-RSS mark, which nothing here reads)
    result = _memory_run(isolated=True)
    peaks = [r["peak_memory_mib"] for r in result["rounds"]]
    assert result["status"] == "ok" and len(peaks) == 4 and all(p > 0 for p in peaks), result
    quiet = [peaks[0], peaks[2], peaks[3]]  # the peak is reset per round: the spike shows in round 1 only
    assert peaks[1] - max(quiet) > 64, peaks
    assert result["peak_memory_min_mib"] == min(peaks) and result["peak_memory_max_mib"] == peaks[1]
    assert result["peak_memory_median_mib"] == pytest.approx(sorted(peaks)[1] / 2 + sorted(peaks)[2] / 2)
    assert result["peak_memory_mib"] >= peaks[1]  # the whole run's peak, as before
    json.dumps(result)


def test_in_process_rounds_leave_the_callers_peak_alone(in_process):
    _, data = in_process
    for v in data["jobs"]["job"]["variants"].values():
        assert [r["peak_memory_mib"] for r in v["rounds"]] == [None] * 3 and v["peak_memory_median_mib"] is None
        assert v["peak_memory_mib"] > 0


def _report_with_memory():
    variants = {}
    for name, (start, peak) in {"fp32": (300.0, 310.0), "O1": (305.0, 345.0)}.items():
        v = new_result(name, True)
        v.update(median_step_ms=1.0, step_ms_min=0.9, step_ms_max=1.2, peak_memory_mib=peak,
                 memory_at_start_mib=start, memory_kind="process RSS peak", loss_scales=[1.0, 1.0],
                 state_mib={"fp32": 0.5, "O1": 0.5}[name])
        variants[name] = v
    return {"job": "j", "variants": variants, "verdict": {"text": "Verdict: stay with O0 (fp32)."}}


def _bars(ax, index=None):
    """(lengths, [(low, high)] of the error bars or None) of the one bar chart on ax (or its ``index``-th); the
    bars are horizontal (a bar's length is its width) or vertical."""
    from matplotlib.container import BarContainer
    containers = [c for c in ax.containers if isinstance(c, BarContainer)]
    (container,) = containers if index is None else containers[index:index + 1]
    along = 0 if container.orientation == "horizontal" else 1
    lengths = [patch.get_width() if along == 0 else patch.get_height() for patch in container.patches]
    if container.errorbar is None:
        return lengths, None
    (segments,) = [c.get_segments() for c in container.errorbar.lines[2]]
    return lengths, [(seg[0][along], seg[1][along]) for seg in segments]


def test_png_shows_each_variants_memory_growth_and_the_step_times_spread():
    """Not whole-process RSS, in which every variant looks the same."""
    Figure = pytest.importorskip("matplotlib.figure").Figure
    axes = plot.draw_row(Figure().subfigures(1, 1), _report_with_memory())
    assert _bars(axes["memory"], 0) == ([10.0, 40.0], None) and "growth" in axes["memory"].get_title()
    assert _bars(axes["memory"], 1) == ([0.5, 0.5], None)  # beside it: weights + grads + optimizer state
    assert _bars(axes["time"]) == ([1.0, 1.0], [(0.9, 1.2), (0.9, 1.2)])
