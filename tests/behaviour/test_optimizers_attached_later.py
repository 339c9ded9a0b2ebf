"""amp_patch.attach_optimizers / next_step_skipped: optimizers built after initialize(models) (the Lightning
plugins' order), without Lightning."""
import math

import pytest
import torch
import torch.nn.functional as F
from tests_support import compute_dtypes

import amp_patch


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)


def test_o2_masters_attached_later_hold_the_exact_fp32_values():
    model = net()
    fp32 = [p.detach().clone() for p in model.parameters()]
    amp_patch.initialize(model, opt_level="O2", half_dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert amp_patch.attach_optimizers(opt) is opt
    masters = list(amp_patch.master_params(opt))
    assert [m.dtype for m in masters] == [torch.float32] * 4
    for m, ref in zip(masters, fp32):  # not the bf16-rounded values
        assert torch.equal(m, ref)
    assert not torch.equal(fp32[0].to(torch.bfloat16).float(), fp32[0])  # (rounding would be visible)
    x, y = batch()
    with amp_patch.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(masters[0], fp32[0])
    assert model[0].weight is masters[0]  # one owner: the model's fp32 param is the master
    assert torch.equal(model.state_dict()["0.weight"], masters[0])
    with pytest.raises(amp_patch.UsageError, match="already attached"):
        amp_patch.attach_optimizers(opt)
    amp_patch.deinitialize()
    assert model[0].weight.dtype == torch.float32 and torch.equal(model[0].weight, masters[0])
    assert opt.param_groups[0]["params"][0] is model[0].weight


def test_unscale_loss_id_takes_over_grads_of_a_backward_outside_scale_loss():
    x, y = batch()
    ref = net()
    F.mse_loss(ref(x), y).backward()
    model = net()
    amp_patch.initialize(model, opt_level="O2", max_loss_scale=2.0 ** 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (F.mse_loss(model(x), y) * amp_patch.loss_scale()).backward()  # what the Fabric plugin does before a step
    amp_patch.attach_optimizers([opt], unscale_loss_id=0)
    assert not amp_patch.next_step_skipped(opt)
    for master, p in zip(amp_patch.master_params(opt), ref.parameters()):
        torch.testing.assert_close(master.grad, p.grad, rtol=1e-2, atol=1e-3)  # fp16 grads, unscaled
    opt.step()
    assert not amp_patch.last_step_skipped(opt)


def test_an_overflow_handed_over_skips_the_next_step():
    model = net()
    amp_patch.initialize(model, opt_level="O1")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()
    (F.mse_loss(model(x), y) * math.inf).backward()
    amp_patch.attach_optimizers(opt, unscale_loss_id=0)
    assert amp_patch.next_step_skipped(opt) and amp_patch.loss_scale() == 2.0 ** 15
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert amp_patch.last_step_skipped(opt) and not amp_patch.next_step_skipped(opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_attach_before_initialize_and_wrong_objects_are_refused():
    opt = torch.optim.SGD(net().parameters(), lr=0.1)
    with pytest.raises(amp_patch.UsageError, match=r"attach_optimizers\(\) was called before amp_patch.initialize"):
        amp_patch.attach_optimizers(opt)
    with pytest.raises(amp_patch.UsageError, match=r"next_step_skipped\(\) was called before"):
        amp_patch.next_step_skipped(opt)
    amp_patch.initialize(net(), opt_level="O1")
    with pytest.raises(amp_patch.ConfigError, match="optimizers must be a torch.optim.optimizer.Optimizer"):
        amp_patch.attach_optimizers("sgd")


def test_state_dict_and_load_before_the_optimizers_are_attached():
    """Between initialize(model) and attach_optimizers the model's state_dict holds the kept fp32 values and
    load_state_dict writes them (a checkpoint loaded then must become the masters, not the initial weights)."""
    model = net()
    fp32 = {k: v.clone() for k, v in model.state_dict().items()}
    amp_patch.initialize(model, opt_level="O2")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in fp32.items())
    loaded = {k: v + 0.001 for k, v in fp32.items()}
    model.load_state_dict(loaded)
    opt = amp_patch.attach_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for master, (name, value) in zip(amp_patch.master_params(opt), loaded.items()):
        assert master.dtype == torch.float32 and torch.equal(master, value), name
    assert compute_dtypes(model, batch()[0])["0.weight"] == torch.float16  # (the forward's compute copy)


def test_a_model_only_o2_session_gives_the_exact_fp32_weights_back():
    model = net()
    fp32 = {k: v.clone() for k, v in model.state_dict().items()}
    amp_patch.initialize(model, opt_level="O2")
    x, _ = batch()
    assert model(x).dtype == torch.float32 and compute_dtypes(model, x)["0.weight"] == torch.float16
    amp_patch.deinitialize()
    for key, value in model.state_dict().items():  # not the fp16-rounded values
        assert value.dtype == torch.float32 and torch.equal(value, fp32[key]), key
