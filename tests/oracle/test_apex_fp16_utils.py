"""apex.fp16_utils (amp_patch.legacy.apex.fp16_utils): FP16_Optimizer used as public scripts call it
(``FP16_Optimizer(opt, static_loss_scale=..., dynamic_loss_scale=True, dynamic_loss_args=..., verbose=False)``,
``optimizer.backward(loss)``, ``clip_master_grads``, ``overflow``, ``loss_scale``, checkpoints) and the
fp16util helpers. Model copies are bf16 (fp16 CPU kernels are slow here); the masters must be exact fp32 math."""
import copy

import pytest
import torch

from amp_patch.errors import ConfigError
from amp_patch.legacy.apex import fp16_utils
from amp_patch.legacy.apex.fp16_utils import (
    BN_convert_float,
    DynamicLossScaler,
    FP16_Optimizer,
    FP16Model,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
)

HALF = torch.bfloat16


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(HALF)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=g).to(HALF), torch.randn(16, 2, generator=g)


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _unscaled_grads(model, x, y):
    """The fp32 grads a step must apply: backward of the unscaled loss through a copy of the half model."""
    twin = copy.deepcopy(model)
    _loss(twin, x, y).backward()
    return [p.grad.float() for p in twin.parameters()]


def test_dynamic_scaling_trains_and_skips_an_injected_inf_step():
    model, (x, y) = _model(), _data()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 2.0 ** 8}, verbose=False)
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters) and all(p.dtype == HALF for p in model.parameters())
    losses = []
    for i in range(8):
        opt.zero_grad()
        before = [m.detach().clone() for m in masters]
        momenta = [opt.state[m]["momentum_buffer"].clone() for m in masters] if i else None
        loss = _loss(model, x, y)
        if i == 4:
            loss = loss * float("inf")
        opt.backward(loss)
        norm = opt.clip_master_grads(100.0)
        opt.step()
        if i == 4:
            assert opt.overflow and norm == -1 and opt.loss_scale == 2.0 ** 7
            assert all(torch.equal(m, b) for m, b in zip(masters, before))
            assert all(torch.equal(opt.state[m]["momentum_buffer"], v) for m, v in zip(masters, momenta))
        else:
            assert not opt.overflow and float(norm) > 0
            losses.append(to_python_float(loss))
        assert all(torch.equal(p.detach(), m.detach().to(HALF)) for p, m in zip(model.parameters(), masters))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("kwargs", [dict(static_loss_scale=128.0), dict(dynamic_loss_scale=True)])
def test_first_step_applies_the_unscaled_grads_to_the_fp32_masters(kwargs):
    model, (x, y) = _model(), _data()
    start = [p.detach().float() for p in model.parameters()]
    expected = [s - 0.5 * g for s, g in zip(start, _unscaled_grads(model, x, y))]
    if kwargs.get("dynamic_loss_scale"):
        kwargs["dynamic_loss_args"] = {"init_scale": 2.0 ** 10}  # a power of two: (un)scaling is exact
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.5), verbose=False, **kwargs)
    opt.backward(_loss(model, x, y))
    opt.step()
    masters = [p for g in opt.param_groups for p in g["params"]]
    for m, e in zip(masters, expected):
        torch.testing.assert_close(m.detach(), e, rtol=1e-6, atol=1e-7)
    assert opt.loss_scale == kwargs.get("static_loss_scale", 2.0 ** 10)


def test_accumulating_backwards_then_update_master_grads():
    """Megatron's pattern: backward(loss, update_master_grads=False) per micro-batch, then update_master_grads()."""
    model, (x, y) = _model(), _data()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=64.0, verbose=False)
    expect = [a + b for a, b in zip(_unscaled_grads(model, x[:8], y[:8]), _unscaled_grads(model, x[8:], y[8:]))]
    opt.backward(_loss(model, x[:8], y[:8]), update_master_grads=False)
    opt.backward(_loss(model, x[8:], y[8:]), update_master_grads=False)
    opt.update_master_grads()
    for m, e in zip(opt.fp32_from_fp16_groups[0], expect):
        torch.testing.assert_close(m.grad, e, rtol=1e-2, atol=1e-4)  # (the half grads accumulate in bf16)


def test_state_dict_round_trip_continues_bit_for_bit():
    model, (x, y) = _model(), _data()
    opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True, verbose=False)

    def train(model, opt, n):
        for _ in range(n):
            opt.zero_grad()
            opt.backward(_loss(model, x, y))
            opt.step()

    train(model, opt, 3)
    saved = copy.deepcopy(opt.state_dict())
    assert set(saved) == {"loss_scaler", "dynamic_loss_scale", "overflow", "first_closure_call_this_step",
                          "optimizer_state_dict", "fp32_from_fp16"}
    other_model = _model()  # fresh weights: the checkpoint must overwrite masters and model
    other = FP16_Optimizer(torch.optim.Adam(other_model.parameters(), lr=1e-2), dynamic_loss_scale=True,
                           verbose=False)
    other.load_state_dict(saved)
    assert other.loss_scale == opt.loss_scale
    train(model, opt, 3)
    train(other_model, other, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other_model.parameters()))
    with pytest.raises(ConfigError, match="dynamic_loss_scale"):
        FP16_Optimizer(torch.optim.SGD(_model().parameters(), lr=0.1)).load_state_dict(saved)


def test_argument_checks():
    with pytest.raises(ConfigError, match="scale_window"):
        FP16_Optimizer(torch.optim.SGD(_model().parameters(), lr=0.1), dynamic_loss_scale=True,
                       dynamic_loss_args={"window": 10})
    opt = FP16_Optimizer(torch.optim.SGD(_model().parameters(), lr=0.1), static_loss_scale=8.0)
    opt.loss_scale = 32.0
    assert opt.loss_scale == 32.0 and opt.param_groups is opt.optimizer.param_groups


def test_param_list_helpers_round_trip():
    model = _model()
    for flat in (False, True):
        model_params, masters = prep_param_lists(model, flat_master=flat)
        assert all(m.dtype == torch.float32 for m in masters) and len(model_params) == 4
        for p in model_params:
            p.grad = torch.full_like(p, 0.5)
        model_grads_to_master_grads(model_params, masters, flat_master=flat)
        assert all(torch.equal(m.grad, torch.full_like(m, 0.5)) for m in masters)
        with torch.no_grad():
            for m in masters:
                m.add_(1.0)
        old = [p.detach().float().clone() for p in model_params]
        master_params_to_model_params(model_params, masters, flat_master=flat)
        assert all(torch.equal(p.detach(), (o + 1.0).to(HALF)) for p, o in zip(model_params, old))


def test_network_casts_keep_batchnorm_fp32():
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3, affine=False))
    half = network_to_half(copy.deepcopy(net))
    assert half[1][0].weight.dtype == torch.float16 and half[1][1].weight.dtype == torch.float32
    assert half[1][2].running_mean.dtype == torch.float16  # (Apex kept only affine batch norms in fp32)
    converted = convert_network(copy.deepcopy(net), torch.float16)
    assert converted[0].weight.dtype == torch.float16 and converted[1].weight.dtype == torch.float32
    assert BN_convert_float(torch.nn.BatchNorm1d(2).half()).weight.dtype == torch.float32
    wrapped = FP16Model(torch.nn.Linear(3, 2))
    assert wrapped(torch.randn(2, 3)).dtype == torch.float16
    assert to_python_float(torch.tensor([2.5])) == 2.5 and to_python_float([3.0]) == 3.0
    assert set(fp16_utils.__all__) >= {"FP16_Optimizer", "to_python_float", "network_to_half", "clip_grad_norm"}


def test_standalone_dynamic_loss_scaler_follows_apex_rule():
    s = DynamicLossScaler(init_scale=4.0, scale_factor=2.0, scale_window=2)
    history = []
    for overflow in (True, True, True, False, False, False):
        s.update_scale(overflow)
        history.append(s.loss_scale)
    assert history == [2.0, 1.0, 1, 1, 2, 2]
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([1.0, float("nan")])
    assert s.has_overflow([p])
