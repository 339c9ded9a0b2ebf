"""apex.fp16_utils.FP16_Optimizer's dynamic scale and printed lines, as in Apex at e13873de: its scaler is
``apex.amp.scaler.LossScaler("dynamic", **dynamic_loss_args)`` (init 2**16 capped at max_loss_scale 2**24, halves
on an overflow floored at min_loss_scale, doubles after scale_window=2000 clean steps, scale_factor ignored), and
it printed its deprecation line, its ``verbose`` lines and one line per overflow-skipped step."""
import types

import pytest
import torch

from amp_patch.legacy.apex.fp16_utils import FP16_Optimizer

DEPRECATED = ("Warning:  FP16_Optimizer is deprecated and dangerous, and will be deleted soon.  If it still works, "
              "you're probably getting lucky.  For mixed precision, use the documented API "
              "https://nvidia.github.io/apex/amp.html, with opt_level=O1.")


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2).to(dtype)


def _step(model, opt, inf=False):
    opt.zero_grad()
    loss = model(torch.ones(3, 4, dtype=next(model.parameters()).dtype)).float().pow(2).mean()
    opt.backward(loss * float("inf") if inf else loss)
    opt.step()
    return opt.overflow


def test_default_dynamic_scale_starts_at_2_16_and_a_half_linear_skips_no_early_step():
    """The adversary's case: a Linear(16, 4).half() with the defaults (the pre-2019 2**32 start skipped 16 of
    its first 30 steps)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.01), dynamic_loss_scale=True, verbose=False)
    assert opt.loss_scale == 2.0 ** 16
    x, y = torch.randn(8, 16).half(), torch.randn(8, 4)
    skipped = []
    for _ in range(10):
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        skipped.append(opt.overflow)
    assert not any(skipped) and opt.loss_scale == 2.0 ** 16


def test_dynamic_loss_args_are_apex_amp_scaler_keywords():
    model = _model()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), dynamic_loss_scale=True, verbose=False,
                         dynamic_loss_args={"init_scale": 2.0 ** 30, "scale_factor": 4.0, "scale_window": 2,
                                            "min_loss_scale": 2.0 ** 22, "max_loss_scale": 2.0 ** 25})
    scales = [opt.loss_scale]  # init capped at max_loss_scale
    for inf in (True, True, True, False, False, False, False, False, False):
        _step(model, opt, inf)
        scales.append(opt.loss_scale)
    # halves (scale_factor is ignored, as in Apex), floored at min, doubles every 2 clean steps up to max
    assert scales == [2.0 ** 25, 2.0 ** 24, 2.0 ** 23, 2.0 ** 22, 2.0 ** 22, 2.0 ** 23, 2.0 ** 23, 2.0 ** 24,
                      2.0 ** 24, 2.0 ** 25]


def test_default_dynamic_scale_halves_without_floor_and_grows_after_2000_clean_steps():
    model = _model()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), dynamic_loss_scale=True, verbose=False,
                         dynamic_loss_args={"init_scale": 2.0})
    for _ in range(3):
        _step(model, opt, inf=True)
    assert opt.loss_scale == 0.25  # no floor at 1 (the old DynamicLossScaler's)
    hp = opt.loss_scaler.hyperparameters
    assert hp["growth_interval"] == 2000 and hp["max_loss_scale"] == 2.0 ** 24 and hp["min_loss_scale"] is None


def test_prints_apex_deprecation_verbose_and_overflow_lines(capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].to(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), dynamic_loss_scale=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [DEPRECATED, "FP16_Optimizer processing param group 0:",
                     "FP16_Optimizer received torch.HalfTensor with torch.Size([3, 4])",
                     "FP16_Optimizer received torch.HalfTensor with torch.Size([3])",
                     "FP16_Optimizer received torch.FloatTensor with torch.Size([2, 3])",
                     "FP16_Optimizer received torch.FloatTensor with torch.Size([2])"]
    opt.zero_grad()
    opt.backward(model[1](model[0](torch.ones(2, 4, dtype=torch.float16)).float()).sum() * float("inf"))
    assert opt.step() is None and opt.overflow
    assert capsys.readouterr().out == "Gradient overflow.  Skipping step, reducing loss scale to 32768.0\n"


@pytest.mark.parametrize("static", [False, True])
def test_quiet_optimizer_prints_only_the_deprecation_line_and_no_line_for_a_clean_step(capsys, static):
    model = _model()
    kwargs = {"static_loss_scale": 8.0} if static else {"dynamic_loss_scale": True}
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False, **kwargs)
    assert capsys.readouterr().out == DEPRECATED + "\n"
    assert not _step(model, opt)
    assert capsys.readouterr().out == ""


def test_load_state_dict_takes_a_pickled_apex_amp_scaler_object():
    """Apex's ``state_dict()["loss_scaler"]`` was its ``amp.scaler.LossScaler`` object (``_loss_scale``)."""
    model = _model()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), dynamic_loss_scale=True, verbose=False)
    saved = opt.state_dict()
    saved["loss_scaler"] = types.SimpleNamespace(_loss_scale=512.0, _unskipped=3, dynamic=True)
    opt.load_state_dict(saved)
    assert opt.loss_scale == 512.0 and opt.loss_scaler.state_dict()["unskipped"] == 3
