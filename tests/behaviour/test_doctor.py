"""amp_patch.doctor / amp-patch doctor on synthetic jobs (tests/_doctor_jobs.py), and skip causes in history()."""
import json
import math

import _doctor_jobs as jobs
import pytest
import torch

import amp_patch
from amp_patch.observe.overflow import skip_cause
from amp_patch.tools import cli
from amp_patch.tools.doctor.training import train

STEPS = 8


@pytest.fixture(scope="module")
def attention_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("doctor") / "fixed.yaml"
    return amp_patch.doctor(jobs.attention_job(), steps=STEPS, out=out), out


def test_attention_overflow_names_bmm_in_the_attention_module(attention_report):
    report, _ = attention_report
    assert report.status == "fixed" and report.exit_code == 0
    first = report.culprits[0]
    assert (first["module"], first["op"], first["category"]) == ("attn", "torch.bmm", "half")
    assert first["source"].startswith("op_lists/apex.yaml:")
    assert first["max_abs_float32"] > torch.finfo(torch.float16).max  # the evidence: it does not fit
    assert report.fixes == [{"target": "torch", "name": "bmm", "scope": "attn"}]
    assert report.before["other_skips"] == STEPS  # q·kᵀ overflows on every step
    # each skip's history() cause names the module, not only "non-finite loss"
    assert report.before["causes"] == ["forward overflow at module attn (last op torch.bmm, half); the loss is "
                                       "non-finite"]
    assert report.after["skipped"] == 0


def test_the_written_list_extends_the_input_and_fixes_training(attention_report):
    report, out = attention_report
    text = out.read_text()
    assert 'extends: "apex"' in text and report.written == str(out)
    table = amp_patch.load_op_lists(str(out))
    assert [(s.glob, [e.qualname for e in s.entries]) for s in table.scopes] == [("attn", ["torch.bmm"])]
    fixed = train(jobs.attention_job(), opt_level="O1", half_dtype=torch.float16, steps=STEPS, op_lists=str(out))
    fp32 = train(jobs.attention_job(), opt_level="O0", half_dtype=torch.float16, steps=STEPS)
    assert not fixed.skips
    assert fixed.final_loss == pytest.approx(fp32.final_loss, rel=0.10)
    markdown = report.to_markdown()
    assert "attn | torch.bmm | half | op_lists/apex.yaml:" in markdown and "```yaml" in markdown
    assert text.endswith("\n")
    # how to measure it: the experiment runs O1 once per list
    assert f"`amp-patch experiment --job MODULE:FUNCTION --half-dtype float16 --variants O0,O1 --op-lists apex {out}`" \
        in markdown


def test_the_markdown_report_has_skips_before_and_after_with_causes_and_the_loss_vs_float32(attention_report):
    report, _ = attention_report
    lines = report.to_markdown().splitlines()
    assert lines[0] == f"# amp-patch doctor: attention (O1, float16, {STEPS} steps)"
    assert lines[2].startswith("**fixed**: op-list change needed: torch.bmm in float32 in 'attn'")
    before = next(line for line in lines if line.startswith("- before: "))
    assert before.startswith(f"- before: {STEPS} steps, {STEPS} skipped (0 warm-up, {STEPS} other), final loss nan")
    assert before.endswith("first failure at step 0: forward overflow at module attn (last op torch.bmm, half); "
                           "the loss is non-finite")
    after = next(line for line in lines if line.startswith("- after the fix: "))
    assert after.startswith(f"- after the fix: {STEPS} steps, 0 skipped (0 warm-up, 0 other), "
                            f"final loss {report.after['final_loss']:.4g}")
    assert f"- float32 (O0) final loss: {report.fp32_final_loss:.4g}" in lines
    for heading in ("## Culprits (first bad value, in execution order)", "## Op-list change", "## Search"):
        assert heading in lines
    assert "- torch.bmm -> float in modules matching 'attn'" in lines


def test_overflowing_custom_reduction_is_moved_to_float_in_its_module():
    report = amp_patch.doctor(jobs.reduction_job(), steps=STEPS)
    assert report.status == "fixed"
    assert report.culprits[0]["module"] == "pool" and report.culprits[0]["op"] == "torch.matmul"
    assert report.fixes == [{"target": "torch", "name": "matmul", "scope": "pool"}]
    assert report.after["other_skips"] == 0
    assert report.after["final_loss"] == pytest.approx(report.fp32_final_loss, rel=0.10)


def test_a_float32_value_beyond_half_range_is_blamed_on_the_op_whose_cast_overflowed():
    report = amp_patch.doctor(jobs.cast_job(), steps=STEPS)
    assert report.status == "fixed"
    first = report.culprits[0]
    assert (first["module"], first["op"], first["where"]) == ("head", "torch.nn.functional.linear",
                                                              "input cast to half")
    assert first["max_abs_float32"] > torch.finfo(torch.float16).max  # the fp32 feature exp() produced
    assert report.fixes == [{"target": "torch.nn.functional", "name": "linear", "scope": "head"}]


def test_nan_from_the_data_is_reported_as_not_fixable(tmp_path):
    out = tmp_path / "never.yaml"
    report = amp_patch.doctor(jobs.nan_data_job(), steps=STEPS, out=out)
    assert report.status == "not_fixable" and report.exit_code == 1
    assert "input(s) [0]" in report.summary and "not fixable by op lists" in report.summary
    assert not report.fixes and not out.exists()


def test_nan_data_via_the_command_line_exits_1_and_says_to_check_the_data(tmp_path, capsys):
    out = tmp_path / "never.yaml"
    status = cli.main(["doctor", "--job", "_doctor_jobs:nan_data_job", "--steps", str(STEPS), "--out", str(out)])
    printed = capsys.readouterr()
    assert status == 1 and printed.err == "" and not out.exists()
    lines = printed.out.splitlines()
    assert lines[0] == f"# amp-patch doctor: _doctor_jobs:nan_data_job (O1, float16, {STEPS} steps)"
    assert lines[2].startswith("**not fixable**: not fixable by op lists: the failure is a genuine non-finite value")
    assert "model input(s) [0] of the batch at step 0 already hold inf/NaN. Check the data" in lines[2]
    before = next(line for line in lines if line.startswith("- before: "))
    assert "first failure at step 0: non-finite loss" in before and "input holds inf/NaN" in before
    assert "## Op-list change" not in lines and "```yaml" not in lines  # nothing proposed, nothing written


def test_healthy_mlp_needs_no_change_via_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))  # (tests/ is already importable: _doctor_jobs)
    out = tmp_path / "unused.yaml"
    status = cli.main(["doctor", "--job", "_doctor_jobs:mlp_job", "--steps", str(STEPS), "--out", str(out),
                       "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["status"] == "healthy" and report["exit_code"] == 0
    assert "no op-list change needed" in report["summary"]
    assert report["fixes"] == [] and not out.exists()


def test_a_healthy_mlp_whose_scaler_backs_off_at_the_start_needs_no_change(capsys):
    """Backoffs before the first applied step, and a later one the scaler recovers from, are the scaler finding
    its scale."""
    status = cli.main(["doctor", "--job", "_doctor_jobs:healthy_backoff_job", "--steps", str(STEPS), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert [s["kind"] for s in train(jobs.healthy_backoff_job(), opt_level="O1", half_dtype=torch.float16,
                                     steps=STEPS).skips] == ["warmup"] * 4 + ["backoff"]  # the job does back off
    assert status == 0 and report["status"] == "healthy", report["summary"]
    assert report["summary"].startswith("no op-list change needed") and report["before"]["other_skips"] == 0
    assert report["before"]["warmup_skips"] == 5 and "1 of them later" in report["summary"]


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_doctor_refuses_o2_o3_saying_why_and_what_to_do(level, tmp_path, capsys):
    with pytest.raises(amp_patch.ConfigError) as refused:
        amp_patch.doctor(jobs.mlp_job(), opt_level=level)
    message = str(refused.value)
    assert message.startswith(f"opt_level={level!r}; allowed: 'O1'.")
    assert "op lists act only through O1's per-op casting" in message and "themselves half" in message  # why
    assert "opt_level='O1'" in message and "keep_fp32_modules=" in message  # what to do
    out = tmp_path / "never.yaml"
    status = cli.main(["doctor", "--job", "_doctor_jobs:mlp_job", "--opt-level", level, "--out", str(out)])
    printed = capsys.readouterr()
    assert status == 2 and printed.out == "" and not out.exists()
    assert printed.err == f"amp-patch doctor: error: {message}\n"  # the same message, not argparse's choices


def test_doctor_refuses_other_opt_levels_and_a_running_session():
    with pytest.raises(amp_patch.ConfigError, match="only through O1's per-op casting"):
        amp_patch.doctor(jobs.mlp_job(), opt_level="O0")
    model = amp_patch.initialize(jobs.mlp_model(), opt_level="O1", verbosity=0)
    try:
        with pytest.raises(amp_patch.UsageError, match="deinitialize"):
            amp_patch.doctor(jobs.mlp_job())
    finally:
        amp_patch.deinitialize()
    assert model is not None


# --- every skipped step explains itself --------------------------------------------------------------------

def _one_step(model, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    with amp_patch.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def _history_of(model, x, y, steps=2, **init):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", verbosity=0, **init)
    try:
        for _ in range(steps):
            _one_step(model, opt, x, y)
        return amp_patch.history()
    finally:
        amp_patch.deinitialize()


def test_history_records_carry_the_cause_of_each_skip():
    x, y = jobs.lambda_free_mlp_data()
    x, y = x[:8], y[:8]
    torch.manual_seed(0)  # how many warm-up skips depends on the init (1 to 3 over seeds): fix it
    warm = _history_of(jobs.mlp_model(), x * 10, y, steps=4)  # 65536 is too high a scale for these grads
    assert [r["cause_kind"] for r in warm] == ["warmup", "warmup", None, None]
    assert "warm-up" in warm[0]["cause"] and warm[2]["cause"] is None and not warm[2]["skipped"]
    grads = _history_of(jobs.mlp_model(), x * 1e3, y, steps=1, loss_scale=2.0 ** 20)  # static: no warm-up
    assert grads[0]["cause_kind"] == "grads" and "params 0.weight" in grads[0]["cause"]
    bad = x.clone()
    bad[0] = math.inf
    nonfinite = _history_of(jobs.mlp_model(), bad, y, steps=1)
    assert nonfinite[0]["cause_kind"] == "loss" and "non-finite loss" in nonfinite[0]["cause"]


def test_skips_from_a_forward_overflow_name_the_module_in_history_and_bad_data_is_named_as_such():
    x, y = jobs.attention_data()
    records = _history_of(jobs.AttentionNet(), x[:8], y[:8], steps=2, diagnose_overflow=True)
    assert [(r["skipped"], r["cause_kind"]) for r in records] == [(True, "forward")] * 2
    assert all(r["cause"].startswith("forward overflow at module attn (last op torch.bmm, half)") for r in records)
    x, y = jobs.nan_data()  # the first module's output is NaN too, but its input (the data) already was
    records = _history_of(jobs.mlp_model(), x[:8], y[:8], steps=1, diagnose_overflow=True)
    assert records[0]["cause_kind"] == "loss" and "input holds inf/NaN" in records[0]["cause"]
    assert records[0]["overflow"]["input_nonfinite"] is True


def test_forward_overflow_is_named_before_warm_up_and_grads():
    origin = {"module": "blocks.1.attn", "op": "torch.bmm", "category": "half"}
    overflow = {"first_bad_module": origin, "params": [{"param": "w"}]}
    kind, text = skip_cause([torch.tensor(1.0)], overflow, True, 65536.0, lambda: [])
    assert kind == "forward" and "blocks.1.attn" in text and "torch.bmm" in text


def test_the_written_list_extends_a_custom_input_list_by_a_relative_path(tmp_path):
    (tmp_path / "lists").mkdir()
    (tmp_path / "out").mkdir()
    mine = tmp_path / "lists" / "mine.yaml"
    mine.write_text("extends: apex\nadd:\n  float:\n    torch: [tanh]\n")
    out = tmp_path / "out" / "fixed.yaml"
    report = amp_patch.doctor(jobs.reduction_job(), steps=STEPS, op_lists=str(mine), out=str(out))
    assert report.status == "fixed"
    assert 'extends: "../lists/mine.yaml"' in out.read_text()
    table = amp_patch.load_op_lists(str(out))
    assert table.category_of("torch", "tanh") == "float"  # the input list's own change is kept
    assert [s.glob for s in table.scopes] == ["pool"]


def test_log_of_zero_is_not_fixable_and_the_op_is_named():
    report = amp_patch.doctor(jobs.log_zero_job(), steps=4)
    assert report.status == "not_fixable" and report.exit_code == 1
    assert "torch.log" in report.summary and "in float32 too" in report.summary
    assert report.culprits[0]["op"] == "torch.log"


def test_a_failure_that_replays_clean_at_loss_scale_one_is_blamed_on_the_loss_scale():
    from amp_patch.tools.doctor import api
    from amp_patch.tools.doctor.training import Failure, Run
    from amp_patch.tools.experiment.models import as_job
    job = as_job(jobs.mlp_job())
    x, y = jobs.lambda_free_mlp_data()
    run = Run("O1", failure=Failure(5, "grads", "non-finite gradients", job.model_fn().state_dict(),
                                    [x[:16], y[:16]]))
    report = api.DoctorReport("mlp", "O1", "float16", STEPS, api.HEALTHY, "", {})
    assert api._diagnose(report, job, run, torch.float16, "apex") is None
    assert report.status == "not_fixable" and "came from the loss scale" in report.summary


def test_an_op_overflowing_in_every_layer_gets_one_layer_glob_and_in_one_layer_that_layer():
    every = amp_patch.doctor(jobs.layered_job(), steps=4)
    assert every.status == "fixed" and every.fixes == [{"target": "torch", "name": "bmm", "scope": "blocks.*"}]
    one = amp_patch.doctor(jobs.layered_one_hot_job(), steps=4)
    assert one.status == "fixed" and one.fixes == [{"target": "torch", "name": "bmm", "scope": "blocks.1"}]
    assert any("narrowed" in line for line in one.log)


def test_consecutive_gradient_backoffs_after_warm_up_count_as_the_scaler_finding_its_scale():
    """65536 skipped (warm-up), 32768 applied, then 32768 and 16384 skipped and 8192 applied: the issue's pattern
    (it was counted as one warm-up skip and two real ones)."""
    from amp_patch.tools.doctor import training
    run = training.Run("O1")
    history = [(0, True, "warmup"), (1, False, None), (2, True, "grads"), (3, True, "grads"), (4, False, None)]
    for step, skipped, kind in history:
        if skipped:
            run.skips.append({"step": step, "kind": kind, "cause": "c", "scale": 1.0})
            if kind != "warmup" and run.failure is None:
                run.failure = training.Failure(step, kind, "c", {}, [])
        else:
            training._recovered(run, step)
    run.losses.append(1.0)
    assert [s["kind"] for s in run.skips] == ["warmup", "backoff", "backoff"]
    assert run.failure is None and run.healthy and len(run.warmup_skips) == 3
