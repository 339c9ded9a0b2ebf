"""One rule for every "faster" the experiment prints: a lead is significant for the pair it compares (op lists
against each other too, not only against fp32); the rows go in the order of the step time they show; two variants
that computed the same thing are said to be identical (a real GPT-2 from a transformers config)."""
import pathlib
import shutil

import _tool_models  # noqa: F401 - the job module the experiment loads by name

from amp_patch.tools.experiment import run_experiment
from amp_patch.tools.experiment.report import markdown, summarize
from amp_patch.tools.experiment.runner import Config, new_result
from amp_patch.tools.experiment.verdict import pair_ratio


def _result(name, medians, losses=(2.0, 1.9, 1.8), casts=10):
    r = new_result(name, True)
    r["rounds"] = [{"round": i, "median_step_ms": m} for i, m in enumerate(medians)]
    r["median_step_ms"] = sorted(medians)[len(medians) // 2]
    r["step_ms_min"], r["step_ms_max"] = min(medians), max(medians)
    r.update(losses=list(losses), loss_scales=[1.0] * len(losses), final_loss=losses[-1],
             casts_per_iteration=casts, weight_casts_per_iteration=casts // 2)
    return r


def _summary(results):
    return summarize("j", Config(steps=5, rounds=3), results, True)


def test_a_lead_over_another_op_list_that_is_not_significant_is_not_called_the_fastest():
    report = _summary({"fp32": _result("fp32", [10, 10, 10], casts=0),
                       "O1 [a]": _result("O1 [a]", [5.0, 5.2, 4.8], losses=(2.0, 1.9, 1.81)),
                       "O1 [b]": _result("O1 [b]", [5.1, 5.0, 4.9], losses=(2.0, 1.9, 1.82))})
    text = report["verdict"]["text"]
    assert pair_ratio(report["variants"]["O1 [a]"], report["variants"]["O1 [b]"])["significant"] is False
    assert "the fastest" not in text, text
    assert "O1 [a] is significantly faster than fp32" in text and "so is O1 [b]" in text
    assert "either will do" in text and "includes 1.00x" in text
    assert [n for n, _ in report["verdict"]["ties"]] == ["O1 [b]"]


def test_a_significant_lead_over_every_other_variant_is_the_fastest():
    report = _summary({"fp32": _result("fp32", [10, 10, 10], casts=0),
                       "O1 [a]": _result("O1 [a]", [5, 5, 5], losses=(2.0, 1.9, 1.81)),
                       "O1 [b]": _result("O1 [b]", [6, 6, 6], losses=(2.0, 1.9, 1.82))})
    text = report["verdict"]["text"]
    assert "O1 [a] is the fastest variant" in text and "significantly faster than O1 [b] too" in text


def test_rows_go_in_the_order_of_the_step_time_they_show():
    """B's median per-round ratio to fp32 is lower, but its median step time (the figure shown) is higher."""
    report = _summary({"fp32": _result("fp32", [10, 20, 10], casts=0),
                       "A": _result("A", [6, 12, 5], losses=(2.0, 1.9, 1.81)),
                       "B": _result("B", [5.8, 9, 6.2], losses=(2.0, 1.9, 1.82))})
    assert report["variants"]["B"]["ratio_to_fp32"] < report["variants"]["A"]["ratio_to_fp32"]
    rows = [line.split("|")[1].strip() for line in markdown(report).splitlines() if line.startswith("| ")][1:]
    assert rows == ["O0 (fp32)", "A", "B"]


def test_two_copies_of_one_op_list_on_gpt2_are_said_to_compute_identically(tmp_path):
    copy = tmp_path / "copy.yaml"
    shutil.copy(pathlib.Path(__file__).resolve().parents[2] / "op_lists" / "torch_cpu.yaml", copy)
    (report,) = run_experiment(["_tool_models:gpt2_job"], variants="fp32,O1", steps=3, rounds=1, isolate=False,
                               progress=False, op_lists=["torch_cpu", str(copy)])
    a, b = report["variants"]["O1 [torch_cpu]"], report["variants"]["O1 [copy.yaml]"]
    assert a["status"] == b["status"] == "ok" and a["losses"] == b["losses"]
    text = report["verdict"]["text"]
    assert [sorted(group) for group in report["verdict"]["identical"]] == [["O1 [copy.yaml]", "O1 [torch_cpu]"]]
    assert "compute identically (the same losses bitwise, the same" in text
    # neither is said to be faster than the other
    assert "O1 [torch_cpu] is " not in text and "O1 [copy.yaml] is " not in text
    assert "O1 [torch_cpu] over O1 [copy.yaml]" not in text and "O1 [copy.yaml] over O1 [torch_cpu]" not in text



def test_two_identical_computations_measured_apart_make_every_lead_noise():
    """Identical twins whose rounds differ one way every time: the machine's noise is larger than any lead."""
    report = _summary({"fp32": _result("fp32", [10, 10, 10], casts=0),
                       "O1 [a]": _result("O1 [a]", [2, 2, 2]), "O1 [b]": _result("O1 [b]", [9, 9.5, 9.9])})
    text = report["verdict"]["text"]
    assert report["verdict"]["fastest"] is None and "fastest" not in text.split(";")[0]
    assert "the step times are the machine's noise here, O1 [a] and O1 [b] compute identically" in text
