"""A submodule's ``state_dict()`` holds fp32 values where amp_patch cast the model to half, as Apex's
``O2StateDictHook`` on every module gave; the whole model's ``state_dict()`` is unchanged by it.

Under the apex alias (O2's two-copy layout: half model params, fp32 masters in the optimizer) a submodule's
state_dict holds its masters, as the whole model's does.
"""
import pytest
import torch

import amp_patch
from amp_patch.legacy import amp


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
        self.register_buffer("scale", torch.full((2,), 1.0 / 3))

    def forward(self, x):
        return self.block(self.l(x)) * self.scale


def _net():
    torch.manual_seed(0)
    m = Net()
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def _train(m, opt, api):
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        opt.zero_grad()
        with api.scale_loss(m(torch.randn(3, 4, generator=g)).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()


def _masters_by_name(m, opt):
    """The fp32 master of each model param, by name (the optimizer holds them in the model's order)."""
    return dict(zip([n for n, _ in m.named_parameters()], amp.master_params(opt)))


def test_apex_alias_o2_submodule_state_dicts_hold_the_fp32_masters():
    m, opt = _net()
    m, opt = amp.initialize(m, opt, opt_level="O2", verbosity=0)
    _train(m, opt, amp)
    assert m.l.weight.dtype is torch.float16  # the two-copy layout
    masters = _masters_by_name(m, opt)
    for path in ("l", "block", "block.0", "block.2"):
        sub = m.get_submodule(path)
        sd = sub.state_dict()
        floating = {k: v for k, v in sd.items() if v.is_floating_point()}
        assert {v.dtype for v in floating.values()} == {torch.float32}, path
        for key, value in floating.items():
            name = f"{path}.{key}"
            if name in masters:
                assert torch.equal(value, masters[name]), name


def test_whole_model_state_dict_is_bitwise_the_same_with_submodule_hooks():
    m, opt = _net()
    m, opt = amp.initialize(m, opt, opt_level="O2", verbosity=0)
    _train(m, opt, amp)
    whole = m.state_dict()
    masters = _masters_by_name(m, opt)
    for name, master in masters.items():
        assert torch.equal(whole[name], master) and whole[name].dtype is torch.float32
    assert whole["scale"].dtype is torch.float32
    sub = m.block.state_dict(prefix="x.")
    assert all(torch.equal(sub[f"x.{k[len('block.'):]}"], v) for k, v in whole.items() if k.startswith("block."))


def test_apex_alias_submodule_state_dict_carries_in_place_edits_of_the_half_params():
    m, opt = _net()
    m, opt = amp.initialize(m, opt, opt_level="O2", verbosity=0)
    with torch.no_grad():
        m.block[0].weight.data.fill_(0.5)
    sd = m.block.state_dict()
    assert sd["0.weight"].dtype is torch.float32 and bool((sd["0.weight"] == 0.5).all())


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_own_api_submodule_state_dicts_hold_fp32(opt_level):
    m, opt = _net()
    m, opt = amp_patch.initialize(m, opt, opt_level=opt_level, verbosity=0)
    for path in ("l", "block", "block.1"):
        sd = m.get_submodule(path).state_dict()
        assert {v.dtype for v in sd.values() if v.is_floating_point()} == {torch.float32}, path
