"""The tools' smaller answers, on real models (tests/_tool_models.py): trace lists only the job's ops, the starting
line counts the variants that run, a near-miss opt level gets its hint."""
import _tool_models as zoo
import torch

import amp_patch.scaling.unscale as unscale
from amp_patch.tools import cli
from amp_patch.tools.experiment.models import as_job
from amp_patch.tools.trace_cli import trace_one_iteration


def test_trace_does_not_list_amp_patchs_own_work_as_the_jobs_op(monkeypatch):
    """Whatever amp_patch runs as scale_loss exits (here: a patched torch.stack in its finiteness check) is not
    the job's op."""
    calls = []
    for name in ("_any_nonfinite", "_unscale_groups", "_found_flag", "_pooled_check"):  # (every unscale path takes one)
        original = getattr(unscale, name)

        def spy(*args, original=original, **kwargs):
            calls.append(torch.stack([torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.float32)]))
            return original(*args, **kwargs)
        monkeypatch.setattr(unscale, name, spy)
    tracer = trace_one_iteration(as_job(zoo.gpt2_job()), half_dtype=torch.float16, op_lists="apex")
    assert calls, "the spy never ran: the test no longer reaches scale_loss's exit"
    assert "torch.stack" not in tracer.to_markdown()
    assert "torch.matmul" in tracer.to_markdown()  # the job's own ops are still listed


def test_the_starting_line_counts_one_variant_per_op_list(capsys, tmp_path):
    cli.main(["experiment", "--job", "_tool_models:masked_job", "--variants", "fp32,O1", "--op-lists", "apex",
              "torch_cpu", "--steps", "3", "--rounds", "1", "--no-isolate", "--out", str(tmp_path)])
    assert "starting 3 variants in this process" in capsys.readouterr().err


def test_an_opt_level_written_with_a_digit_zero_gets_the_hint(capsys):
    assert cli.main(["speed", "--job", "_tool_models:gpt2_job", "--opt-level", "01"]) == 2
    assert "digit zero" in capsys.readouterr().err


def test_after_ctrl_c_each_final_loss_says_after_how_many_steps():
    from test_experiment_pairwise_claims import _result, _summary

    from amp_patch.tools.experiment.report import markdown

    results = {"fp32": _result("fp32", [10, 10, 10], casts=0), "O1": _result("O1", [5, 5], losses=(2.0, 1.9))}
    for r in results.values():
        r["steps_run"] = len(r["losses"])
    text = markdown(_summary(results))
    assert "1.8000 (after 3 steps)" in text and "1.9000 (after 2 steps)" in text


def test_a_reference_whose_own_loss_rises_is_remarked():
    from test_experiment_pairwise_claims import _result, _summary

    results = {"fp32": _result("fp32", [10, 10, 10], losses=(2.0, 3.0, 9.0), casts=0),
               "O1": _result("O1", [5, 5, 5], losses=(2.0, 3.0, 9.0))}
    assert "the reference diverges: fp32's own loss rose from 2 to 9" in _summary(results)["verdict"]["text"]
