"""The differential against real Apex: random programs through Apex's amp API (``apex_programs``), run under real
Apex's amp Python code on CPU (``apex_real``, NVIDIA/apex e13873de named by ``AMP_PATCH_APEX_SRC``) and under
amp_patch's alias, must agree **bitwise**: every loss, scale, ``_unskipped``, model weight and master param after
every step, and where a run raises. Programs in a documented difference class (``apex_programs.known_difference``,
docs/migration.md) are compared only for running to the end.

Fast profile (CI): ``apex_programs.PROFILES["fast"]`` programs; ``AMP_PATCH_APEX_DIFFERENTIAL=long`` for the
long one. Skipped without an Apex checkout.
"""
import os

import apex_programs
import apex_real
import pytest
import torch

import amp_patch
from amp_patch import legacy

PROFILE = os.environ.get("AMP_PATCH_APEX_DIFFERENTIAL", "fast")
pytestmark = pytest.mark.skipif(apex_real.source() is None,
                                reason=f"no Apex checkout: set {apex_real.ENV} to NVIDIA/apex at e13873de")


@pytest.fixture(scope="module")
def real_apex_traces(tmp_path_factory):
    out = tmp_path_factory.mktemp("apex") / "traces.pt"
    apex_real.run_under_real_apex(PROFILE, apex_programs.PROFILES[PROFILE], out)
    return torch.load(out, weights_only=False)


def _ours(program):
    try:
        return apex_programs.run(legacy.amp, program)
    finally:
        if amp_patch.session.state.current() is not None:
            amp_patch.deinitialize()


def test_random_programs_agree_bitwise_with_real_apex(real_apex_traces):
    disagree, known = [], 0
    for seed, theirs in enumerate(real_apex_traces):
        program = apex_programs.draw(seed)
        ours = _ours(program)
        if apex_programs.known_difference(program):
            known += 1
            assert ours[-1][0] != "raised" or theirs[-1][0] == "raised", (apex_programs.describe(program), ours[-1])
            continue
        diff = apex_programs.first_difference(theirs, ours)
        if diff:
            disagree.append(f"{apex_programs.describe(program)}\n    {diff}")
    assert not disagree, f"{len(disagree)} of {len(real_apex_traces) - known} programs differ:\n" + "\n".join(
        disagree[:5])


def test_the_differential_sees_a_wrong_scaler_rule(real_apex_traces, monkeypatch):
    """Guard against a harness that cannot fail: with GradScaler's count-once rule (amp_patch's own API) in place
    of Apex's under the alias, some program with an overflow in a step of several micro-batches differs."""
    from amp_patch.session import scale_loss, step_outcome

    for module in (scale_loss, step_outcome):
        monkeypatch.setattr(module, "apex_rules", lambda session: False)
    seeds = [seed for seed in range(len(real_apex_traces))
             if not apex_programs.known_difference(apex_programs.draw(seed))
             and any(m["inf"] for s in apex_programs.draw(seed)["steps"] for m in s["micro"][:-1])]
    assert seeds, "the profile draws no program with an overflow before a step's last micro-batch"
    assert any(apex_programs.first_difference(real_apex_traces[s], _ours(apex_programs.draw(s))) for s in seeds)


def test_a_model_with_its_own_submodule_agrees_bitwise_with_real_apex(tmp_path):
    """OpenNMT-py's ``amp.initialize([model, model.generator], ...)`` under O2/O3, either order: where real Apex
    trains, amp_patch's alias gives the same outputs, losses, scales and masters bitwise; where the generator's
    fp32 outputs (Apex's cast) reached another half layer of the model, Apex raised a dtype mismatch and the
    alias trains (docs/migration.md)."""
    import apex_nested_programs

    out = tmp_path / "nested.pt"
    apex_real.run_under_real_apex("nested", 0, out)
    theirs_all = torch.load(out, weights_only=False)
    disagree = []
    for program, theirs in zip(apex_nested_programs.PROGRAMS, theirs_all, strict=True):
        try:
            ours = apex_nested_programs.run(legacy.amp, program)
        finally:
            amp_patch.deinitialize()
        assert ours[-1][0] != "raised", (apex_nested_programs.describe(program), ours[-1])
        if program["shape"] == "inside_mid":
            assert theirs[-1][0] == "raised" and "dtype" in theirs[-1][1], theirs[-1]
            continue
        diff = apex_programs.first_difference(theirs, ours)
        if diff:
            disagree.append(f"{apex_nested_programs.describe(program)}: {diff}")
    assert not disagree, "\n".join(disagree)


def test_o2_steps_no_loss_reached_agree_bitwise_with_real_apex(tmp_path):
    """Apex's O2 ``zero_grad`` zeroed the fp32 params' grads in place: a step whose loss reaches none of them (or
    no loss at all) still applies momentum and weight decay to them (BatchNorm kept fp32), bitwise as Apex."""
    import apex_zero_grad_programs

    out = tmp_path / "zero_grad.pt"
    apex_real.run_under_real_apex("zero_grad", 0, out)
    disagree = []
    for program, theirs in zip(apex_zero_grad_programs.PROGRAMS, torch.load(out, weights_only=False), strict=True):
        try:
            ours = apex_zero_grad_programs.run(legacy.amp, program)
        finally:
            amp_patch.deinitialize()
        assert theirs[-1][0] != "raised", theirs[-1]
        diff = apex_programs.first_difference(theirs, ours)
        if diff:
            disagree.append(f"{apex_zero_grad_programs.describe(program)}: {diff}")
    assert not disagree, "\n".join(disagree)
