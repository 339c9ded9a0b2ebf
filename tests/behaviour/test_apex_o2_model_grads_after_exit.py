"""Under Apex's API (O2, fp32 masters beside half model params) the half model grads stay in ``param.grad`` after a
``scale_loss`` exit, still multiplied by the loss scale, as Apex left them (its ``scale_loss`` docstring: "the fp16
model grads will remain scaled after context manager exit"): scripts that log per-param grad norms read them. The
next ``scale_loss`` entry drops them (they are already in the master grads), as Apex's next backward did, so
nothing is counted twice; ``optimizer.zero_grad()`` drops them too."""
import warnings

import torch
from torch import nn

import amp_patch
from amp_patch.legacy import amp


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    return model, opt, torch.randn(5, 4).half()


def _backward(model, opt, x):
    with amp.scale_loss(model(x).float().mean(), opt) as scaled:
        scaled.backward()


def test_the_half_model_grads_stay_scaled_after_the_exit_beside_the_unscaled_master_grads():
    model, opt, x = _setup()
    _backward(model, opt, x)
    scale = amp._amp_state.loss_scalers[0].loss_scale()
    for p, master in zip(model.parameters(), amp.master_params(opt)):
        assert p.grad is not None and p.grad.dtype is torch.float16
        torch.testing.assert_close(p.grad.float() / scale, master.grad, rtol=1e-3, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (clipping model params under two copies warns: it clips no master)
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9) > 0


def test_the_next_backward_replaces_them_and_the_masters_are_counted_once():
    model, opt, x = _setup()
    _backward(model, opt, x)
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    _backward(model, opt, x)
    _backward(model, opt, x)  # two accumulating backwards: the kept half grads of the first are not added again
    ref = [m.grad.clone() for m in amp.master_params(opt)]
    opt.zero_grad()
    _backward(model, opt, x)
    for master, twice in zip(amp.master_params(opt), ref):
        torch.testing.assert_close(2 * master.grad, twice, rtol=1e-3, atol=1e-6)
    opt.step()  # no "gradients that no scale_loss block produced" refusal for the kept grads
    amp_patch.deinitialize()
