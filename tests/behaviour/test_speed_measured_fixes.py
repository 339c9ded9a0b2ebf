"""``amp-patch speed`` prints a fix only when it measured it faster on this machine (interleaved pairs, each one
faster), with the time it saves; on a real model (transformers GPT-2 with n_embd=36) the fix names the user's
modules and the config field, not a file inside site-packages. The load-dependent findings are tested with an
injected slow phase (tests/behaviour/test_speed_report.py's ``slow_odd_sizes``)."""
import sysconfig
import time

import pytest
import torch
from test_speed_report import slow_odd_sizes  # noqa: F401 - the fixture

import amp_patch

STEPS = 12


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_padding_that_gains_nothing_here_is_not_printed():
    """On this CPU bfloat16 has no tiles: padding GPT-2's 36-wide projections measures no faster, so no fix."""
    from amp_patch.tools.speed import measure

    calls = []

    def spy(before, after, cuda=False, pairs=measure.PAIRS):
        calls.append(before)  # what this CPU measures for bfloat16 without tiles: the pairs straddle 1.00x
        return measure.Gain(before_ms=1.0, after_ms=0.99, low=0.93, high=1.06, pairs=pairs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measure, "compare", spy)
        report = amp_patch.speed_report("_tool_models:gpt2_odd_job", steps=STEPS)
    assert calls, "no padding was measured"
    assert "alignment" not in report.kinds(), report.to_text()


def test_a_measured_padding_gain_names_the_users_modules_and_config_field(slow_odd_sizes):  # noqa: F811
    report = amp_patch.speed_report("_tool_models:gpt2_odd_job", steps=STEPS)
    found = next(f for f in report.findings if f.kind == "alignment")
    assert "module lm.transformer.h." in found.where and "n_embd=36 (lm.config)" in found.where
    assert sysconfig.get_paths()["purelib"] not in found.where and "site-packages" not in found.where
    assert "set n_embd=36 (lm.config) -> 40 in the model's config" in found.fix
    assert "padded as advised" in found.figure and "instead of" in found.figure and "saved" in found.figure


def test_a_loader_that_workers_do_not_speed_up_gets_no_data_loading_finding(monkeypatch):
    """A loaded machine makes the healthy job wait for its (cheap) batches; workers measured no faster: no fix."""
    from amp_patch.tools.speed import harness

    monkeypatch.setattr(harness.Measurements, "phase_share", lambda self, phase: 0.5 if phase == "data" else 0.2)
    report = amp_patch.speed_report("_speed_jobs:healthy", steps=STEPS)
    assert "data_loading" not in report.kinds(), report.to_text()


def test_the_phase_shares_add_up_to_the_whole_step():
    report = amp_patch.speed_report("_speed_jobs:healthy", steps=STEPS)
    assert sum(report.phases.values()) == pytest.approx(1.0)
    # whether the half dtype runs on hardware here, as the experiment says
    assert "bfloat16 runs" in report.half_hardware and "bfloat16 runs" in report.to_text()


def _slow_amp_patch_steps(monkeypatch, seconds):
    from amp_patch.tools.speed import native

    original = native.step

    def slow(mode, *args):
        if mode == "amp_patch":
            time.sleep(seconds)
        return original(mode, *args)
    monkeypatch.setattr(native, "step", slow)


def test_amp_patchs_own_casting_cost_against_native_autocast_is_a_finding_with_the_native_list(monkeypatch):
    """An injected slow phase in amp_patch's steps (its casting, on a machine where it costs): measured against
    native torch.autocast on the same GPT-2, round by round."""
    _slow_amp_patch_steps(monkeypatch, 0.05)
    report = amp_patch.speed_report("_tool_models:gpt2_job", steps=STEPS)
    found = next(f for f in report.findings if f.kind == "op_list_overhead")
    assert "native torch.autocast" in found.figure and "slower in every one of 5 interleaved rounds" in found.figure
    assert "op_lists='torch_cpu'" in found.fix and "casts per step" in found.where


def test_no_overhead_finding_when_amp_patch_is_not_measured_slower(monkeypatch):
    _slow_amp_patch_steps(monkeypatch, 0.0)
    from amp_patch.tools.speed import native

    monkeypatch.setattr(native, "Overhead", type("NoisyOverhead", (native.Overhead,), {
        "significant": property(lambda self: False)}))
    report = amp_patch.speed_report("_tool_models:gpt2_job", steps=STEPS)
    assert "op_list_overhead" not in report.kinds()
