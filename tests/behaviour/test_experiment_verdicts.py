"""The experiment answers "which opt level and which op list?": op lists as variants, a verdict that recommends
only a significant lead, fp32 always the reference, refusals that say why, and an honest Ctrl-C summary."""
import argparse

import pytest
from test_experiment import tiny_data, tiny_loss, tiny_model, tiny_optimizer

from amp_patch.errors import ConfigError
from amp_patch.tools import cli
from amp_patch.tools.experiment import Job, api, command, compare, run_experiment
from amp_patch.tools.experiment.report import markdown, summarize
from amp_patch.tools.experiment.runner import Config, new_result
from amp_patch.tools.experiment.verdict import ranking, verdict

TINY = ["--job", "test_experiment:tiny_job", "--no-isolate", "--no-progress"]


def _tiny(**kw):
    kw.setdefault("progress", False)
    kw.setdefault("isolate", False)
    return compare(tiny_model, tiny_optimizer, tiny_data, tiny_loss, batch_size=8, **kw)


def test_op_lists_run_o1_once_per_list_named_after_the_list(tmp_path):
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text("extends: apex\nadd:\n  float:\n    torch.nn.functional: [linear]\n")
    report = _tiny(variants="fp32,O1", steps=4, op_lists=["apex", str(fixed)])
    variants = report["variants"]
    assert list(variants) == ["fp32", "O1 [apex]", "O1 [fixed.yaml]"]
    assert all(v["status"] == "ok" for v in variants.values()), {n: v["error"] for n, v in variants.items()}
    # the fixed list runs linear in float32: no weight cast, and the loss of fp32 exactly
    assert variants["O1 [apex]"]["weight_casts_per_iteration"] > 0
    assert variants["O1 [fixed.yaml]"]["weight_casts_per_iteration"] == 0
    assert variants["O1 [fixed.yaml]"]["losses"] == variants["fp32"]["losses"]
    assert "| O1 [fixed.yaml] | ok |" in markdown(report)


def test_a_jobs_own_op_lists_make_its_o1_rows():
    job = Job(tiny_model, tiny_optimizer, tiny_data, tiny_loss, batch_size=8, name="own", op_lists=("torch_cpu",))
    (report,) = run_experiment([job], variants="fp32,O1", steps=3, isolate=False, progress=False)
    assert list(report["variants"]) == ["fp32", "O1 [torch_cpu]"]


def test_op_lists_from_the_command_line_and_their_mistakes(capsys, tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("extends: apex\nadd:\n  flaot: {}\n")
    assert cli.main(["experiment"] + TINY + ["--steps", "3", "--op-lists", str(bad), "--out", str(tmp_path)]) == 2
    assert "typo.yaml:" in capsys.readouterr().err  # file:line, before any variant ran
    assert cli.main(["experiment"] + TINY + ["--steps", "3", "--variants", "O2", "--op-lists", "apex",
                                             "--out", str(tmp_path)]) == 2
    assert "apply to O1 only" in capsys.readouterr().err
    assert cli.main(["experiment"] + TINY + ["--steps", "3", "--op-lists", "apex", "torch_cpu", "--variants",
                                             "O1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| O1 [apex] | ok |" in out and "| O1 [torch_cpu] | ok |" in out and "| O0 (fp32) | ok |" in out


def _v(name, ratio, low, high, rounds=5, status="ok", losses=(2.0, 1.0)):
    v = new_result(name, True)
    v.update(status=status, losses=list(losses), ratio_to_fp32=ratio, ratio_to_fp32_min=low, ratio_to_fp32_max=high,
             ratio_to_fp32_rounds=rounds,
             ratio_to_fp32_significant=None if ratio is None else name == "fp32" or (
                 rounds >= 3 and not low <= 1.0 <= high))
    return v


def test_a_lead_that_is_not_significant_is_never_recommended():
    variants = {"fp32": _v("fp32", 1.0, 1.0, 1.0), "O3": _v("O3", 0.80, 0.13, 8.28),
                "native": _v("native", 1.3, 1.2, 1.4)}
    result = verdict(variants)
    assert result["fastest"] == "fp32"
    assert result["text"].startswith("Verdict: no significant difference over 5 rounds: stay with fp32, or rerun "
                                     "with more --rounds/--steps (O3, whose loss stays within 5% of fp32's, measured "
                                     "0.80x, not significant: its rounds' min-max 0.13-8.28 includes 1.00x)")


def test_a_significant_lead_is_recommended_and_a_faster_unproven_one_named():
    variants = {"fp32": _v("fp32", 1.0, 1.0, 1.0), "O3": _v("O3", 0.5, 0.3, 1.2), "O2": _v("O2", 0.7, 0.6, 0.8)}
    text = verdict(variants)["text"]
    # O3's lead over O2 is not proven, nor O2's over O3: O2 is not called "the fastest"
    assert text.startswith("Verdict: O2 is significantly faster than fp32 with its loss within 5% of fp32's: 0.70x "
                           "fp32's step time (significant over 5 rounds); O3 measured 0.50x, not significant")


def test_two_rounds_never_make_a_ratio_significant():
    def fake(name, medians):
        r = new_result(name, True)
        r["rounds"] = [{"round": i, "median_step_ms": m} for i, m in enumerate(medians)]
        return r

    report = summarize("j", Config(steps=4, rounds=2), {"fp32": fake("fp32", [2.0, 2.0]),
                                                        "O3": fake("O3", [1.0, 1.1])}, True)
    o3 = report["variants"]["O3"]
    assert o3["ratio_to_fp32_max"] < 1.0 and o3["ratio_to_fp32_significant"] is False
    assert "no significant difference over 2 rounds" in report["verdict"]["text"]
    assert "needs at least 3" in report["verdict"]["text"]


def test_the_table_and_the_verdict_rank_alike():
    variants = {"fp32": _v("fp32", 1.0, 1.0, 1.0), "O1": _v("O1", 1.2, 1.1, 1.3), "O2": _v("O2", 0.6, 0.5, 0.7),
                "O3": _v("O3", 0.9, 0.8, 0.95)}
    assert ranking(variants) == ["O2", "O3", "fp32", "O1"]
    for v in variants.values():
        v.update(median_step_ms=1.0, step_ms_min=1.0, step_ms_max=1.0, ratio_to_native=None,
                 max_loss_deviation_from_fp32=0.0)
    report = {"job": "j", "steps": 40, "half_dtype": "bfloat16", "device": "cpu", "seed": 0, "isolated": True,
              "threads": 1, "rounds": 5, "interleaved": True, "variants": variants, "verdict": verdict(variants)}
    rows = [line.split("|")[1].strip() for line in markdown(report).splitlines() if line.startswith("| O")]
    assert rows == ["O0 (fp32)", "O2", "O3", "O1"]
    assert report["verdict"]["fastest"] == "O2"


def test_fp32_is_added_as_the_reference(capsys, tmp_path):
    assert cli.main(["experiment"] + TINY + ["--steps", "3", "--variants", "O1,O2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| O0 (fp32) | ok |" in out and "| O1 | ok | " in out
    o1_row = next(line for line in out.splitlines() if line.startswith("| O1 |"))
    assert o1_row.split("|")[4].strip() != "-"  # a ratio to fp32


@pytest.mark.parametrize("steps", ["1", "2"])
def test_a_run_that_would_time_no_step_is_refused(steps, capsys, tmp_path):
    assert cli.main(["experiment"] + TINY + ["--steps", steps, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"steps={steps}: no step would be timed" in err and "pass steps >= 3" in err


def test_a_quick_check_says_it_runs_fewer_rounds(capsys, tmp_path):
    assert cli.main(["experiment", "--job", "test_experiment:tiny_job", "--no-isolate", "--steps", "4",
                     "--variants", "fp32", "--out", str(tmp_path)]) == 0
    starting = [line for line in capsys.readouterr().err.splitlines() if line.startswith("starting")]
    assert starting == ["starting 1 variant in this process (4 steps, bfloat16, cpu; 2 timed steps, so 2 rounds "
                        "instead of 5 (a significant verdict needs 3))..."]


@pytest.mark.parametrize("value", ["5", "1.5"])
def test_a_loss_tolerance_above_one_is_refused_with_a_hint(value, capsys, tmp_path):
    assert cli.main(["experiment"] + TINY + ["--steps", "3", "--loss-tolerance", value, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a fraction of fp32's loss" in err and "(0.05: a loss within 5% of fp32's)" in err
    with pytest.raises(ConfigError):
        api._check_tolerance(float(value))


def _interrupted_report():
    """fp32 finished one of five rounds, then Ctrl-C: O1 and O2 never ran."""
    fp32 = new_result("fp32", True)
    fp32.update(status="interrupted", error="Ctrl-C after 1 of 5 round(s)", losses=[2.0, 1.9, 1.8],
                rounds=[{"round": 0, "median_step_ms": 1.0}], median_step_ms=1.0, step_ms_min=1.0, step_ms_max=1.0)
    others = {n: new_result(n, True) for n in ("O1", "O2")}
    for v in others.values():
        v.update(status="interrupted", error="Ctrl-C after 0 of 5 round(s)")
    report = summarize("j", Config(steps=12, rounds=5), {"fp32": fp32, **others}, True)
    report["partial"] = True
    return report


def test_the_ctrl_c_summary_says_only_what_ran():
    report = _interrupted_report()
    text = markdown(report)
    assert "median over 1 round (of 5 planned: Ctrl-C stopped the rest)" in text
    assert "nothing to compare: no variant besides fp32 (O0) finished a timed round" in report["verdict"]["text"]
    assert "stay with" not in report["verdict"]["text"]
    assert "interrupted: interrupted" not in text and "**O1** interrupted: Ctrl-C after 0 of 5 round(s)" in text
    assert "None" not in text


def test_ctrl_c_after_every_round_finished_is_not_marked_partial():
    report = {"rounds": 5, "variants": {"fp32": {"status": "ok", "rounds": [{}] * 5},
                                        "O1": {"status": "ok", "rounds": [{}] * 5}}}
    kept = command._kept(argparse.Namespace(out="out"), [report])
    assert kept == "; all 2 variant run(s) had finished their rounds; written to out/experiment.json"
    assert "partial" in command._kept(argparse.Namespace(out="out"), [report], jobs_left=True)


def test_state_mib_counts_weights_grads_and_optimizer_state_once_each():
    report = _tiny(variants="fp32,O1,O2", steps=3)
    v = report["variants"]
    params = sum(p.numel() for p in tiny_model().parameters())  # SGD without momentum: no optimizer state
    fp32_bytes = params * 4 * 2  # weights and grads
    assert v["fp32"]["state_mib"] * 2 ** 20 == fp32_bytes
    assert v["O1"]["state_mib"] == v["fp32"]["state_mib"]  # O1 keeps fp32 weights: its casts are transient
    # O2 as step() begins: the fp32 params, the only weights, with their fp32 grads (4 + 4); the half compute
    # copies lived for the forward only
    assert v["O2"]["state_mib"] * 2 ** 20 == params * (4 + 4)
    text = markdown(report)
    assert "| state MiB |" in text and "State MiB: weights + grads + optimizer state" in text


def test_the_report_says_whether_the_half_dtype_runs_on_hardware_here():
    from amp_patch.tools.machine import half_hardware
    report = _tiny(variants="fp32", steps=3)
    expected = half_hardware("cpu", "bfloat16").sentence()
    assert report["machine"].endswith(expected)
    assert f"Machine: {report['machine']}." in markdown(report)
    assert "bfloat16 runs on hardware" in expected or "bfloat16 runs in software only" in expected


def test_an_unquoted_version_says_yaml_read_it_as_a_number(tmp_path):
    bad = tmp_path / "version.yaml"
    bad.write_text("extends: apex\nadd:\n  half:\n    torch:\n      - name: matmul\n        min_torch: 2.10\n")
    import amp_patch
    from amp_patch.errors import OpListError
    with pytest.raises(OpListError) as raised:
        amp_patch.load_op_lists(str(bad))
    assert "matmul: min_torch: YAML read 2.10 as the number 2.1, not the version 2.10; quote the version: " \
           'min_torch: "2.10"' in str(raised.value)


def test_an_opt_level_with_whitespace_gets_a_hint():
    import torch

    import amp_patch
    with pytest.raises(ConfigError, match=r"whitespace around it: use 'O1'"):
        amp_patch.initialize(torch.nn.Linear(2, 2), opt_level="O1 ", verbosity=0)


def test_one_process_per_variant_serves_every_job_and_ends_with_the_experiment():
    """Starting a variant process (importing torch) costs seconds of CPU: a quick check of three jobs must not
    start fifteen. Each variant keeps its own process, and that process runs the variant's jobs in turn."""
    import os

    jobs = [Job(tiny_model, tiny_optimizer, tiny_data, tiny_loss, batch_size=8, name=n) for n in ("a", "b")]
    first, second = run_experiment(jobs, variants="fp32,O1", steps=3, isolate=True, progress=False)
    pids = {name: (first["variants"][name]["pid"], second["variants"][name]["pid"]) for name in ("fp32", "O1")}
    assert pids["fp32"][0] == pids["fp32"][1] != pids["O1"][0] == pids["O1"][1]
    assert all(r["variants"][n]["status"] == "ok" for r in (first, second) for n in ("fp32", "O1"))
    assert second["variants"]["O1"]["isolated"] and second["variants"]["O1"]["peak_memory_mib"] > 0
    for pid in (pids["fp32"][0], pids["O1"][0]):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_summary_gives_the_span_of_rounds_when_ctrl_c_stopped_one_row_a_round_earlier():
    rows = {}
    for name, done in (("fp32", 5), ("O1", 5), ("O2", 4)):
        result = new_result(name, True)
        result.update(status="ok" if done == 5 else "interrupted", losses=[2.0, 1.9],
                      rounds=[{"round": i, "median_step_ms": 1.0} for i in range(done)], median_step_ms=1.0,
                      step_ms_min=1.0, step_ms_max=1.0)
        rows[name] = result
    report = summarize("j", Config(steps=12, rounds=5), rows, True)
    assert (report["rounds_finished"], report["rounds_finished_fewest"]) == (5, 4)
    assert "median over 4-5 rounds (of 5 planned: Ctrl-C stopped the rest)" in markdown(report)
