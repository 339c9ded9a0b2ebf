"""The doctor on masked attention (tests/_tool_models.py): a mask's own -inf (``masked_fill(mask, -inf)``, Hugging
Face GPT-2's ``finfo.min + finfo.min``) is told apart from a float16 overflow, whose op and fix are found."""
import _tool_models as zoo
import pytest

import amp_patch

STEPS = 2
_REPORTS = {}


def _doctor(make):
    if make not in _REPORTS:
        _REPORTS[make] = amp_patch.doctor(make(), steps=STEPS)
    return _REPORTS[make]


@pytest.mark.parametrize("make, scope", [(zoo.masked_hot_job, None), (zoo.gpt2_hot_job, "lm.transformer.h.*.attn"),
                                         (zoo.bert_hot_job, "bert.encoder.layer.*.attention.self")],
                         ids=["masked_fill_-inf", "hf_gpt2_eager", "hf_bert_eager"])
def test_an_overflow_behind_an_intended_minus_inf_mask_is_found_and_fixed(make, scope):
    report = _doctor(make)
    assert report.status == "fixed", report.summary
    assert report.culprits[0]["op"] == "torch.matmul" and report.culprits[0]["category"] == "half"
    assert report.fixes == [{"target": "torch", "name": "matmul", "scope": scope}]
    assert report.after["other_skips"] == 0 and report.before["other_skips"] == STEPS


def test_the_report_names_the_masks_it_did_not_count_as_failures():
    report = _doctor(zoo.masked_hot_job)
    assert report.intended == ["(model): masked_fill"]
    assert "intended non-finite values" in report.to_markdown() and "(model): masked_fill" in report.to_markdown()


def test_a_non_finite_float32_loss_is_still_genuine():
    """log(relu(x)) is -inf in float32 too, and so is the loss: not a mask."""
    import _doctor_jobs

    report = amp_patch.doctor(_doctor_jobs.log_zero_job(), steps=STEPS)
    assert report.status == "not_fixable" and "genuine" in report.summary
