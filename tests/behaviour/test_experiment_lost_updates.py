"""Lost updates: the experiment measures the share of weights a step leaves unchanged (a nonzero gradient, no
change), shows it in the table and says it in the verdict; O3 is never recommended without it."""
from test_experiment_pairwise_claims import _result, _summary

from amp_patch.tools.experiment import run_experiment
from amp_patch.tools.experiment.report import markdown


def test_o3_on_gpt2_with_a_small_learning_rate_loses_updates_that_fp32_keeps():
    (report,) = run_experiment(["_tool_models:gpt2_small_lr_job"], variants="fp32,O3", steps=3, rounds=1,
                               isolate=False, progress=False)
    fp32, o3 = report["variants"]["fp32"], report["variants"]["O3"]
    assert o3["status"] == "ok" and o3["unchanged_by_update"] > 0.5  # bfloat16 weights: most SGD updates round away
    assert fp32["unchanged_by_update"] < 0.05
    text = markdown(report)
    assert "| weights a step left unchanged |" in text and f"{o3['unchanged_by_update']:.1%}" in text
    assert "flagged: O3 lost updates: a step left" in report["verdict"]["text"]


def test_o3_is_recommended_only_with_its_lost_updates():
    results = {"fp32": _result("fp32", [10, 10, 10], casts=0),
               "O3": _result("O3", [5, 5, 5], losses=(2.0, 1.9, 1.81), casts=4)}
    results["O3"]["unchanged_by_update"] = 0.38
    text = _summary(results)["verdict"]["text"]
    assert text.startswith("Verdict: O3 is the fastest variant") and "but a step left 38% of the weights" in text
    results["O3"]["unchanged_by_update"] = 0.001
    assert "a step left 0.1% of its weights unchanged (no lost updates)" in _summary(results)["verdict"]["text"]
    results["O3"]["unchanged_by_update"] = None
    assert "its lost updates not measured" in _summary(results)["verdict"]["text"]
