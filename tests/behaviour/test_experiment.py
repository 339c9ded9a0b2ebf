"""End-to-end tests of amp_patch.tools.experiment on tiny jobs (a few steps each; no timing assertions)."""
import argparse
import io
import json
import os
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import amp_patch
from amp_patch.tools.experiment import add_parser, compare, run_experiment
from amp_patch.tools.experiment.report import Progress

# --- tiny jobs (module-level so that spawned variant processes can import them) ------------------------------


def tiny_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def tiny_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def tiny_data():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(32, 8, generator=gen)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def tiny_loss(output, target):
    return F.cross_entropy(output, target)


def tiny_job():
    return {"model_fn": tiny_model, "optimizer_fn": tiny_optimizer, "data_fn": tiny_data, "loss_fn": tiny_loss,
            "batch_size": 8}


class RefusesAutocast(nn.Module):
    """Fails under native torch.autocast only: every other variant trains normally."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("this model refuses torch.autocast")
        return self.lin(x)


class Overflows(nn.Module):
    """Its activations exceed float16's range once the weights are float16 (O3), not in float32."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x):
        return self.lin(x) * 1e6


def _run(model_fn, variants, **kw):
    kw.setdefault("steps", 3)
    kw.setdefault("progress", False)
    return compare(model_fn, tiny_optimizer, tiny_data, tiny_loss, variants=variants, batch_size=8, **kw)


# --- tests ---------------------------------------------------------------------------------------------------

def test_all_variants_in_process_report_structure(tmp_path):
    threads = torch.get_num_threads()
    report = _run(tiny_model, ("fp32", "O1", "O2", "O3", "native"), steps=4, isolate=False, out_dir=tmp_path,
                  name="tiny", threads=1)
    assert amp_patch.session.state.current() is None and torch.get_num_threads() == threads
    assert report["threads"] == 1
    data = json.loads((tmp_path / "experiment.json").read_text())
    assert list(data["jobs"]) == ["tiny"]
    assert data["jobs"]["tiny"]["variants"].keys() == report["variants"].keys()
    assert list(report["variants"]) == ["fp32", "O1", "O2", "O3", "native"]
    for name, v in data["jobs"]["tiny"]["variants"].items():
        assert v["status"] == "ok", (name, v["error"])
        assert v["steps_run"] == 4 and len(v["losses"]) == 4 and len(v["loss_scales"]) == 4
        assert v["median_step_ms"] > 0 and len(v["step_times_ms"]) == 2  # warm-up and counted steps untimed
        assert v["syncs_per_step"] == "n/a (CPU)"
        assert "RSS" in v["memory_kind"] and v["peak_memory_mib"] > 0
        assert v["skipped_steps"] == 0 and v["final_loss_scale"] == 1.0  # bfloat16: no loss scaling
        assert isinstance(v["max_loss_deviation_from_fp32"], float)
        assert v["ratio_to_fp32"] > 0 and v["ratio_to_native"] > 0
    variants = report["variants"]
    assert variants["fp32"]["ratio_to_fp32"] == 1.0 and variants["native"]["ratio_to_native"] == 1.0
    assert variants["fp32"]["max_loss_deviation_from_fp32"] == 0.0
    assert variants["fp32"]["casts_per_iteration"] == 0
    # O1 and native autocast cast each of the 4 weights once per iteration; O2/O3 cast the model up front
    assert variants["O1"]["distinct_weights_cast"] == variants["O1"]["weight_casts_per_iteration"] == 4
    assert variants["native"]["weight_casts_per_iteration"] == 4
    assert variants["O3"]["weight_casts_per_iteration"] == 0 < variants["O3"]["casts_per_iteration"]


def test_png_is_a_valid_image(tmp_path):
    pytest.importorskip("matplotlib")
    _run(tiny_model, ("fp32", "O1"), steps=3, isolate=False, out_dir=tmp_path)
    assert (tmp_path / "experiment.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_isolated_variants_report_their_own_run(tmp_path):
    report = _run(tiny_model, ("fp32", "O2"), half_dtype=torch.float16, isolate=True, out_dir=tmp_path)
    fp32, o2 = report["variants"]["fp32"], report["variants"]["O2"]
    assert fp32["status"] == o2["status"] == "ok", (fp32["error"], o2["error"])
    assert fp32["isolated"] and o2["isolated"]
    assert len({fp32["pid"], o2["pid"], os.getpid()}) == 3
    assert fp32["final_loss_scale"] == 1.0 and o2["final_loss_scale"] == 2.0 ** 16  # O2 fp16: dynamic scaling
    assert fp32["casts_per_iteration"] == 0 < o2["casts_per_iteration"]
    assert fp32["losses"] != o2["losses"] and abs(fp32["losses"][0] - o2["losses"][0]) < 0.05
    assert "process RSS peak" == fp32["memory_kind"]
    if sys.platform.startswith("linux"):  # the variant's own process: its peak is measured per round too
        for v in (fp32, o2):
            (peak,) = [r["peak_memory_mib"] for r in v["rounds"]]
            assert 0 < peak == v["peak_memory_min_mib"] == v["peak_memory_max_mib"] <= v["peak_memory_mib"]


def test_failing_variant_is_reported_and_others_still_run():
    report = _run(RefusesAutocast, ("fp32", "native", "O1"), isolate=False)
    variants = report["variants"]
    assert variants["native"]["status"] == "failed"
    assert "RuntimeError: this model refuses torch.autocast" in variants["native"]["error"]
    assert "refuses" in variants["native"]["traceback"]
    assert variants["fp32"]["status"] == variants["O1"]["status"] == "ok"
    assert variants["O1"]["casts_per_iteration"] > 0 == variants["fp32"]["casts_per_iteration"]
    assert variants["native"]["ratio_to_fp32"] is None and variants["O1"]["ratio_to_native"] is None
    from amp_patch.tools.experiment import format_reports
    text = format_reports([report])
    assert "| native | failed |" in text and "this model refuses torch.autocast" in text


def test_diverging_variant_is_reported(tmp_path):
    report = _run(Overflows, ("fp32", "O3"), half_dtype=torch.float16, isolate=False, out_dir=tmp_path)
    fp32, o3 = report["variants"]["fp32"], report["variants"]["O3"]
    assert fp32["status"] == "ok" and fp32["steps_run"] == 3
    assert o3["status"] == "diverged" and o3["steps_run"] == 1
    assert "the loss became" in o3["error"]
    assert o3["max_loss_deviation_from_fp32"] == float("inf")
    data = json.loads((tmp_path / "experiment.json").read_text())  # strict JSON: non-finite floats as strings
    assert data["jobs"]["job"]["variants"]["O3"]["max_loss_deviation_from_fp32"] == "inf"


def test_isolate_needs_importable_functions():
    with pytest.raises(amp_patch.ConfigError, match="isolate=False"):
        compare(lambda: tiny_model(), tiny_optimizer, tiny_data, tiny_loss, steps=3, progress=False)
    with pytest.raises(amp_patch.ConfigError, match="allowed"):
        _run(tiny_model, ("fp32", "O4"), isolate=False)
    with pytest.raises(ValueError, match="steps"):
        _run(tiny_model, ("fp32",), steps=0, isolate=False)


def _cli(argv):
    parser = argparse.ArgumentParser(prog="amp-patch")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["experiment"] + argv)
    return args.func(args)


def test_cli_runs_a_user_job(tmp_path, capsys):
    code = _cli(["--job", f"{__name__}:tiny_job", "--variants", "fp32,O1", "--steps", "3", "--no-isolate",
                 "--no-progress", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "### tiny_job: 3 steps, bfloat16, cpu" in out and "| O1 | ok |" in out and "| O0 (fp32) | ok |" in out
    assert json.loads((tmp_path / "experiment.json").read_text())["jobs"]["tiny_job"]["steps"] == 3


def test_cli_rejects_a_bad_job(tmp_path, capsys):
    assert _cli(["--job", "no_such_module_xyz:job", "--out", str(tmp_path)]) == 2
    assert "cannot import" in capsys.readouterr().err
    assert not (tmp_path / "experiment.json").exists()


def test_builtin_job_by_spec_in_process():
    [report] = run_experiment(["amp_patch.tools.experiment.models:mlp"], variants="O1", steps=3, isolate=False,
                              progress=False)
    assert report["job"] == "mlp" and report["variants"]["O1"]["status"] == "ok"


def test_progress_is_one_starting_line_when_not_a_tty():
    """The command says it started at once; a file or a pipe gets no progress bar."""
    stream = io.StringIO()
    bar = Progress(2, 5, stream=stream)
    bar.announce("starting 2 variants in separate processes...")
    for label in ("a", "b"):
        bar.start(label)
        bar.step(3)
        bar.end_run("ok")
    bar.close()
    assert stream.getvalue().splitlines() == ["starting 2 variants in separate processes..."]
