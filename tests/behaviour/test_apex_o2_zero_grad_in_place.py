"""Under Apex's API at O2, ``optimizer.zero_grad()`` zeroes the grads of the fp32 params the optimizer holds
(BatchNorm, kept fp32) in place and drops only the masters' grads, as Apex's patched ``zero_grad`` did, so a step
that no loss reached still applies momentum and weight decay to those params (bitwise against real Apex in
tests/oracle/test_apex_differential.py). amp_patch's own API keeps torch's ``set_to_none``."""
import pytest
import torch

import amp_patch
from amp_patch.legacy import amp


def _setup(alias):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    init = amp.initialize if alias else amp_patch.initialize
    model, opt = init(model, opt, opt_level="O2", verbosity=0, **({} if alias else {"half_dtype": torch.float16}))
    loss = model(torch.randn(8, 4).half()).float().pow(2).mean()
    with amp_patch.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return model, opt


def test_zero_grad_zeroes_fp32_param_grads_in_place_and_an_unreached_step_still_moves_them():
    model, opt = _setup(alias=True)
    bn = model[1]
    opt.zero_grad()
    assert bn.weight.grad is not None and not bn.weight.grad.any()
    assert all(m.grad is None for m in amp.master_params(opt) if m is not bn.weight and m is not bn.bias)
    assert model[0].weight.grad is None  # (half model grads: amp_patch's intermediate)
    bn_before, linear_before = bn.weight.detach().clone(), model[0].weight.detach().clone()
    opt.step()  # no loss this step: momentum and weight decay still move the fp32 BatchNorm params
    assert not torch.equal(bn.weight, bn_before)
    assert torch.equal(model[0].weight, linear_before)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_amp_patch_s_own_o2_keeps_torch_s_zero_grad(set_to_none):
    model, opt = _setup(alias=False)
    opt.zero_grad(set_to_none=set_to_none)
    assert (model[1].weight.grad is None) is set_to_none
