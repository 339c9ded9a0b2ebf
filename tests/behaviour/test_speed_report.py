"""``amp-patch speed`` / ``amp_patch.speed_report``: on synthetic jobs that each plant one cause (tests/_speed_jobs.py),
the planted cause is the top finding with its figure, place and fix; a healthy job gets none of them. Timings are
never asserted: each planted cost is many times the rest of its step."""
import json

import _speed_jobs
import pytest
import torch

import amp_patch
from amp_patch.errors import ConfigError, UsageError
from amp_patch.patching import registry
from amp_patch.tools import cli, machine
from amp_patch.tools.speed import findings as findings_module
from amp_patch.tools.speed import harness
from amp_patch.tools.speed.probes import HOST_READS, HostReads
from amp_patch.tools.speed.report import HEALTHY

STEPS = 12  # the least that leaves several plain and timed steps: 2 warm-up, 4 probe, 3 plain, 3 timed
PLANTED = ("data_loading", "host_sync", "alignment", "data_parallel")


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: steadier steps on a shared machine (the figures, not the findings, depend on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def half_runs_on_hardware(monkeypatch):
    """The planted causes are read on a machine whose half dtype runs on hardware (the GPUs and bf16 CPUs users
    tune on). Where it does not, the hardware finding comes first by design: the tests of that finding say so."""
    def on_hardware(device, dtype, flags=None):
        name = str(dtype).removeprefix("torch.")
        return machine.HalfHardware("CPU", name, True, f"{name} read as on hardware by the test")

    monkeypatch.setattr(machine, "half_hardware", on_hardware)


def _report(job, opt_level="O1", **kwargs):
    return amp_patch.speed_report(f"_speed_jobs:{job}", opt_level=opt_level, steps=STEPS, **kwargs)


def _top(report, kind):
    assert report.findings, f"no findings; expected {kind}:\n{report.to_text()}"
    top = report.findings[0]
    assert top.kind == kind, report.to_text()
    assert top.figure and top.fix and top.where
    return top


def test_a_slow_dataset_without_workers_is_the_top_finding():
    top = _top(_report("slow_data"), "data_loading")
    assert "waiting for the next batch" in top.figure
    assert top.share > 0.5
    assert "num_workers=0" in top.where and "SlowDataset" in top.where and "_speed_jobs.py:" in top.where
    assert f"num_workers={findings_module.suggested_workers()}" in top.fix


def test_a_dataset_the_report_batches_names_that_loader():
    top = _top(_report("slow_dataset"), "data_loading")
    assert "built from the job's Dataset" in top.where and "num_workers=0" in top.where


def test_an_item_call_in_forward_is_the_top_finding_at_the_users_line():
    top = _top(_report("item_in_forward"), "host_sync")
    assert top.where.endswith(f"_speed_jobs.py:{_speed_jobs.ITEM_LINE}")
    assert top.figure.startswith("1 host read(s) of tensor values per step: .item() at ")
    assert top.share is None  # on the CPU nothing waits: the cost shows on a GPU
    assert "every N steps" in top.fix


def test_sizes_not_multiples_of_eight_are_the_top_finding_with_padded_sizes():
    top = _top(_report("misaligned"), "alignment")
    assert "2 (Linear: in_features=1001, out_features=999)" in top.where
    assert "in_features 1001 -> 1008, out_features 999 -> 1000" in top.fix
    assert "bfloat16" in top.figure


def test_a_misaligned_matmul_in_the_users_forward_is_named_at_its_line():
    report = _report("odd_matmul")
    found = next(f for f in report.findings if f.kind == "alignment")
    assert f"matmul at tests/_speed_jobs.py:{_speed_jobs.MATMUL_LINE} (k=16, n=999)" in found.where
    assert f"the matmul at tests/_speed_jobs.py:{_speed_jobs.MATMUL_LINE}: n 999 -> 1000" in found.fix
    assert "Linear" not in found.where  # the MLP's own layers are aligned


def test_alignment_is_not_checked_in_fp32():
    assert "alignment" not in _report("misaligned", "O0").kinds()


def test_a_data_parallel_model_is_the_top_finding_with_ddp_as_the_fix():
    top = _top(_report("data_parallel"), "data_parallel")
    assert "DistributedDataParallel" in top.fix and "DataParallel" in top.where


def test_an_optimizer_step_that_dominates_names_its_fused_variant():
    top = _top(_report("heavy_optimizer", "O0"), "optimizer")
    assert top.where.startswith("Adam.step()") and "fused=True" in top.fix


def test_a_healthy_job_has_none_of_the_planted_causes():
    report = _report("healthy")
    assert not set(report.kinds()) & set(PLANTED), report.to_text()


def test_a_healthy_job_in_fp32_gets_the_short_report():
    report = _report("healthy", "O0")
    assert report.findings == [], report.to_text()
    assert HEALTHY in report.to_text()


def test_missing_half_hardware_is_stated_once_and_first(monkeypatch):
    def software_only(device, dtype, flags=None):
        name = str(dtype).removeprefix("torch.")
        return machine.HalfHardware("CPU", name, False, f"none of the {name} flags")

    monkeypatch.setattr(machine, "half_hardware", software_only)
    report = _report("data_parallel")
    assert report.kinds().count("hardware") == 1 and report.kinds()[0] == "hardware"
    assert "no speed-up is possible" in report.findings[0].figure
    assert "O0" in report.findings[0].fix
    assert "hardware" not in _report("healthy", "O0").kinds()  # fp32 needs no half hardware


def test_the_report_states_its_instrumentation_overhead():
    report = _report("healthy", "O0")
    assert isinstance(report.overhead, float) and isinstance(report.probe_overhead, float)
    assert "instrumentation: the phase timers change the step time by" in report.to_text()
    assert set(report.phases) == {"data", "forward", "backward", "optimizer"}


class _Reader:
    """Calls each host read from this file (the user's code, for the probe)."""

    def __call__(self, t):
        t.item()  # READ 1
        t.tolist()
        bool(t)
        float(t)
        int(t)
        repr(t)  # printing calls .tolist()/.item() inside torch: counted once, here
        f"{t}"
        t.cpu()
        t.numpy()


def test_host_reads_are_counted_at_the_users_line_and_undone_exactly():
    before = {name: vars(torch.Tensor).get(name) for name in ("item", "__repr__", "__bool__", "__format__")}
    t = torch.ones(())
    torch.ones(3).sum()  # no read
    with HostReads() as reads:
        assert registry.installed()
        _Reader()(t)
        torch.nn.functional.dropout(torch.ones(4), 0.5)  # torch's own code: not the user's
    assert sorted(what for _, what in reads.sites) == sorted(HOST_READS.values())
    assert all(count == 1 for count in reads.sites.values()), reads.sites
    lines = {site for site, _ in reads.sites}
    assert all(site.split(":")[0].endswith("test_speed_report.py") for site in lines)
    assert registry.installed() == []
    assert {name: vars(torch.Tensor).get(name) for name in before} == before


def test_findings_are_ranked_unmeasurable_first_then_by_share():
    make = findings_module.Finding
    ranked = sorted([make("casts", 0.2, "", "", ""), make("host_sync", None, "", "", ""),
                     make("alignment", 0.5, "", "", ""), make("hardware", None, "", "", "")],
                    key=findings_module._rank)
    assert [f.kind for f in ranked] == ["hardware", "host_sync", "alignment", "casts"]


def test_the_cli_prints_the_report_and_writes_the_json(tmp_path, capsys):
    out = tmp_path / "speed.json"
    status = cli.main(["speed", "--job", "_speed_jobs:item_in_forward", "--steps", str(STEPS), "--json", str(out)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "1. host_sync: " in captured.out
    data = json.loads(out.read_text())
    assert {"findings", "step_ms", "machine"} <= set(data)
    assert data["step_ms"] > 0 and data["machine"] == machine.describe("cpu")
    assert data["findings"][0]["kind"] == "host_sync"
    assert all(set(f) == {"kind", "share", "where", "figure", "fix"} for f in data["findings"])


def test_without_a_job_the_cli_reports_on_the_built_in_mlp(capsys):
    status = cli.main(["speed", "--steps", str(STEPS)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert captured.out.startswith("amp-patch speed: amp_patch.tools.experiment.models:mlp, O1 bfloat16 on cpu")
    machine_line = next(line for line in captured.out.splitlines() if line.startswith("machine: "))
    assert machine_line.endswith(", 1 thread")  # the built-in job runs on 1 thread, as in the experiment


def test_every_line_names_the_thread_count_the_steps_ran_with(monkeypatch, capsys):
    def software_only(device, dtype, flags=None):
        name = str(dtype).removeprefix("torch.")
        return machine.HalfHardware("CPU", name, False, f"none of the {name} flags")

    monkeypatch.setattr(machine, "half_hardware", software_only)
    torch.set_num_threads(2)  # this process's count: the report must name the run's (1), not this one
    status = cli.main(["speed", "--job", "_speed_jobs:healthy", "--half-dtype", "fp16", "--threads", "1",
                       "--steps", str(STEPS)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    named = [line for line in captured.out.splitlines() if "thread" in line]
    assert [line for line in named if line.startswith("machine: ")] and [line for line in named if "hardware" in line]
    assert all(", 1 thread" in line and "1 threads" not in line and "2 thread" not in line for line in named), named


def test_threads_are_set_for_the_run_named_in_the_report_and_restored():
    before = torch.get_num_threads()
    report = amp_patch.speed_report("_speed_jobs:healthy", steps=STEPS, threads=1)
    assert report.machine.endswith(", 1 thread") and torch.get_num_threads() == before


def test_the_cli_refuses_a_job_it_cannot_load_with_exit_2(capsys):
    assert cli.main(["speed", "--job", "no_such_speed_jobs_xyz:make"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("amp-patch speed: error: --job 'no_such_speed_jobs_xyz:make': cannot import")


def test_the_cli_names_the_users_line_when_the_job_raises(capsys):
    assert cli.main(["speed", "--job", "_speed_jobs:raises", "--steps", str(STEPS)]) == 2
    err = capsys.readouterr().err
    assert "raised FileNotFoundError: no such checkpoint" in err and "_speed_jobs.py:" in err


def test_a_job_failing_in_a_probe_step_leaves_no_patch_and_no_session(capsys):
    assert "item" not in vars(torch.Tensor)
    assert cli.main(["speed", "--job", "_speed_jobs:fails_while_probed", "--steps", str(STEPS)]) == 2
    assert "planted failure during a probe step" in capsys.readouterr().err
    assert "item" not in vars(torch.Tensor) and registry.installed() == []
    assert amp_patch.session.state.current() is None


def test_a_job_object_gets_fixes_that_name_a_placeholder_job(monkeypatch):
    monkeypatch.setitem(findings_module.THRESHOLDS, "casts", 0.0)  # O1 always casts: the finding is there
    job = amp_patch.tools.experiment.models.as_job(_speed_jobs.misaligned())
    report = amp_patch.speed_report(job, steps=STEPS)
    assert report.job == "misaligned"
    casts = next(f for f in report.findings if f.kind == "casts")
    assert "`amp-patch experiment --job MODULE:FUNCTION --variants fp32,O1,O3`" in casts.fix
    assert "Only O3 keeps the weights in half" in casts.fix  # O2's fp32 params are cast per call, as O1's


@pytest.mark.parametrize("argv, says", [
    (["--steps", "3"], "steps=3; pass an integer >= 8"),
    (["--half-dtype", "fp32"], "--half-dtype"),
])
def test_the_cli_refuses_bad_arguments_with_exit_2(argv, says, capsys):
    assert cli.main(["speed", "--job", "_speed_jobs:healthy"] + argv) == 2
    assert says in capsys.readouterr().err


def test_the_api_refuses_bad_arguments_and_an_open_session():
    with pytest.raises(ConfigError, match="opt_level='o1'; allowed: O0, O1, O2, O3"):
        amp_patch.speed_report("_speed_jobs:healthy", opt_level="o1")
    model = torch.nn.Linear(2, 2)
    amp_patch.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    try:
        with pytest.raises(UsageError, match="deinitialize"):
            _report("healthy")
    finally:
        amp_patch.deinitialize()


def test_the_experiments_verdict_points_to_the_speed_report_when_nothing_beats_fp32():
    from amp_patch.tools.experiment.verdict import verdict
    ran = {"status": "ok", "losses": [1.0, 0.9], "ratio_to_fp32_significant": False}
    slower = verdict({"fp32": dict(ran, ratio_to_fp32=1.0), "O1": dict(ran, ratio_to_fp32=1.3)})
    assert "`amp-patch speed --job MODULE:FUNCTION` shows what holds its step back" in slower["text"]
    faster = verdict({"fp32": dict(ran, ratio_to_fp32=1.0), "O1": dict(ran, ratio_to_fp32=0.7)})
    assert "amp-patch speed" not in faster["text"]


def test_the_schedule_balances_plain_and_timed_steps_and_spreads_the_probes():
    kinds = harness.schedule(20)
    assert kinds[:2] == ["warmup", "warmup"] and len(kinds) == 20
    assert kinds.count("probe") == 2 and kinds.count("module_probe") == 2
    timing = [k for k in kinds if k in ("plain", "timed")]
    assert timing[:8] == ["plain", "timed", "timed", "plain"] * 2  # each kind first in every other unit
    assert "probe" not in kinds[-2:] and "probe" not in kinds[2:4]


def test_the_overhead_is_the_median_over_units_of_timed_over_plain():
    m = harness.Measurements(plain_ms=[1.0, 1.0, 2.0, 2.0, 1.0], timed_ms=[1.1, 1.1, 2.4, 2.4, 9.0])
    assert [round(u, 6) for u in m.overhead_units()] == [0.1, 0.2, 8.0]
    assert m.overhead() == pytest.approx(0.2)


def test_the_speed_help_prints_and_the_probe_patch_is_catalogued(capsys):
    assert cli.main(["speed", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: amp-patch speed")
    assert any(owner == "tools.speed.probes" for _, owner, _ in registry.CATALOGUE)
