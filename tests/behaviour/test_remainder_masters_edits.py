"""master_weights='remainder' with in-place edits of the bf16 weights and with nested optimizer steps.

An edit (``zero_()``, ``p.data.clamp_``, a submodule's ``load_state_dict``) must never join with the stale
remainder (that gave NaN for a weight set to zero); a fully edited param then equals fp32-master O2 with the split
rule bitwise; a partly edited one keeps the edited elements exactly and the others within half a bf16 ulp (see
``RemainderMasters.carry_edit``). A subclass whose ``step()`` calls ``super().step()`` runs torch's step hooks twice,
nested: the masters are joined and split once."""
import logging

import pytest
import torch

import amp_patch

MODES = {"split": dict(master_weights=True, master_rounding="split"), "remainder": dict(master_weights="remainder")}


def _session(mode, opt_cls=torch.optim.SGD, **opt_kwargs):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = opt_cls(model.parameters(), lr=opt_kwargs.pop("lr", 0.1), **opt_kwargs)
    return amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0, **MODES[mode])


def _steps(model, opt, n=2):
    for i in range(n):
        torch.manual_seed(10 + i)
        with amp_patch.scale_loss(model(torch.randn(5, 4)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("edit", ["zero_", "fill_data", "submodule_load"])
def test_a_fully_edited_weight_is_the_edited_value_as_with_fp32_masters(edit):
    results = {}
    for mode in MODES:
        model, opt = _session(mode)
        _steps(model, opt)
        with torch.no_grad():
            if edit == "zero_":
                model[0].weight.zero_()
            elif edit == "fill_data":
                model[0].weight.data.fill_(0.3)
            else:
                model[1].load_state_dict({"weight": torch.full((2, 3), 0.3), "bias": torch.zeros(2)})
        after_edit = _state(model)
        _steps(model, opt)
        results[mode] = (after_edit, _state(model))
        amp_patch.deinitialize()
    for split, remainder in zip(results["split"], results["remainder"]):
        for name in split:
            assert not remainder[name].isnan().any(), name
            assert torch.equal(split[name], remainder[name]), name


def test_a_partly_clipped_weight_keeps_the_clipped_values_and_warns_once(caplog):
    first, later = {}, {}
    for mode in MODES:
        model, opt = _session(mode)
        _steps(model, opt)
        with caplog.at_level(logging.WARNING, logger="amp_patch"):
            for rounds in (first, later):  # WGAN's critic clipping, each round followed by a step
                for p in model.parameters():
                    p.data.clamp_(-0.2, 0.2)
                rounds[mode] = _state(model)
                _steps(model, opt, 1)
        amp_patch.deinitialize()
    edited = [r for r in caplog.records if "changed in place" in r.getMessage()]
    assert len(edited) == 1  # remainder only, once
    bound = torch.tensor(0.2, dtype=torch.bfloat16).float()
    assert sum(int((v.abs() == bound).sum()) for v in first["split"].values()) > 3  # the clipping bit somewhere
    for name, split in first["split"].items():  # the same history up to the first clipping
        remainder = first["remainder"][name]
        clipped = split.abs() == bound
        assert torch.equal(remainder[clipped], split[clipped]), name
        assert torch.allclose(remainder, split, rtol=2 ** -8, atol=0), name  # the rest: within half a bf16 ulp
    for name, split in later["split"].items():
        assert not later["remainder"][name].isnan().any()
        assert torch.allclose(later["remainder"][name], split, rtol=2 ** -7, atol=0), name


class _SubclassAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        return super().step(closure)


def test_a_subclass_step_calling_super_step_joins_and_splits_once():
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # torch hooks AdamW.step itself from now on
    results = {}
    for mode in MODES:
        model, opt = _session(mode, _SubclassAdamW, lr=1e-2)
        _steps(model, opt, 3)
        results[mode] = _state(model)
        amp_patch.deinitialize()
    for name, split in results["split"].items():
        assert torch.equal(split, results["remainder"][name]), name
