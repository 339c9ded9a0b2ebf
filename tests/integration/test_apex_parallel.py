"""apex.parallel (amp_patch.legacy.apex.parallel): argument handling on a one-rank gloo group, and the gradient
arithmetic, flat collectives, Reducer and CPU SyncBatchNorm on two gloo ranks (one launch)."""
import copy
import logging
import os

import _dist_worker as w
import pytest
import torch
import torch.distributed as dist

from amp_patch.errors import ConfigError
from amp_patch.legacy.apex.parallel import (
    DistributedDataParallel,
    Reducer,
    SyncBatchNorm,
    convert_syncbn_model,
    create_syncbn_process_group,
)
from amp_patch.legacy.apex.parallel.distributed import flat_dist_call

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp_path, "store"), rank=0, world_size=1)
    yield
    import gc

    gc.collect()  # DDP modules must go before their process group
    dist.destroy_process_group()


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))


def _grads(model):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    model(x.to(next(model.parameters()).dtype)).pow(2).sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def test_no_effect_arguments_are_accepted_with_one_info_line(one_rank, caplog):
    with caplog.at_level(logging.INFO, logger="amp_patch"):
        ddp = DistributedDataParallel(_net(), message_size=1e6, delay_allreduce=True, num_allreduce_streams=2,
                                      retain_allreduce_buffers=True, prof=True)
    lines = [r.getMessage() for r in caplog.records if "DistributedDataParallel" in r.getMessage()]
    assert len(lines) == 2 and "message_size=1000000.0" in lines[0] and "num_allreduce_streams=2" in lines[0]
    assert "find_unused_parameters=True" in lines[1]
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and ddp.find_unused_parameters
    assert all(torch.equal(a, b) for a, b in zip(_grads(ddp), _grads(_net())))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="amp_patch"):
        DistributedDataParallel(_net())
    assert not caplog.records


def test_result_changing_arguments_are_honoured_on_one_rank(one_rank):
    local = _grads(_net())
    halved = _grads(DistributedDataParallel(_net(), gradient_average=False, gradient_predivide_factor=2.0))
    assert all(torch.equal(h, g * 0.5) for h, g in zip(halved, local))
    same = _grads(DistributedDataParallel(_net(), gradient_predivide_factor=4.0))
    assert all(torch.equal(s, g) for s, g in zip(same, local))
    bf16 = _net().to(torch.bfloat16)
    expect = _grads(_net().to(torch.bfloat16))
    got = _grads(DistributedDataParallel(bf16, allreduce_always_fp32=True))
    assert all(g.dtype == torch.bfloat16 and torch.equal(g, e) for g, e in zip(got, expect))


def test_refused_arguments_name_the_fix(one_rank):
    with pytest.raises(ConfigError, match="shared_param"):
        DistributedDataParallel(_net(), shared_param=True)
    with pytest.raises(ConfigError, match="positive finite"):
        DistributedDataParallel(_net(), gradient_predivide_factor=0)
    with pytest.raises(ConfigError, match="divide"):
        create_syncbn_process_group(3)


def test_convert_syncbn_model_keeps_params_and_statistics(one_rank):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.Sequential(torch.nn.BatchNorm2d(3)))
    bn = net[1][0]
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.running_mean.uniform_()
    x = torch.randn(2, 2, 3, 3)
    reference = copy.deepcopy(net)(x)
    converted = convert_syncbn_model(net)
    assert isinstance(converted[1][0], SyncBatchNorm) and converted[1][0].running_mean is bn.running_mean
    assert torch.equal(converted[1][0].weight, bn.weight)
    torch.testing.assert_close(converted(x), reference)
    alone = convert_syncbn_model(torch.nn.BatchNorm1d(4))
    assert type(alone) is SyncBatchNorm


def test_apex_ddp_wraps_a_converted_model_on_cpu_but_torch_syncbn_stays_refused(one_rank):
    """torch's DDP refuses SyncBatchNorm on CPU; apex's SyncBatchNorm has a gloo path of its own, torch's has not."""
    ddp = DistributedDataParallel(convert_syncbn_model(torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1),
                                                                           torch.nn.BatchNorm2d(3))))
    ddp(torch.randn(2, 2, 3, 3)).sum().backward()
    del ddp
    torch_syncbn = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(3)))
    with pytest.raises(ValueError, match="SyncBatchNorm layers only work with GPU modules"):
        DistributedDataParallel(torch_syncbn)


def test_apex_ddp_frees_its_reducer_before_its_python_process_group(one_rank):
    """The group's last reference must be the Python one, whose destructor releases the GIL before joining gloo's
    workers (freed last by the C++ reducer, it joins holding the GIL: a worker that needs it hangs the exit)."""
    import weakref

    ddp = DistributedDataParallel(_net())
    reducer, group = weakref.ref(ddp.__dict__["reducer"]), ddp.process_group
    ddp.__del__()
    assert reducer() is None and "logger" not in ddp.__dict__ and ddp.process_group is group


def test_fuse_relu_and_residual(one_rank):
    bn = SyncBatchNorm(3, fuse_relu=True).eval()
    x, z = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    plain = torch.nn.BatchNorm1d(3).eval()
    torch.testing.assert_close(bn(x, z), torch.relu(plain(x) + z))


def test_flat_dist_call_and_reducer_on_one_rank(one_rank):
    tensors = [torch.ones(3), torch.arange(4.0).to(torch.bfloat16)]
    flat_dist_call(tensors, dist.all_reduce)
    assert torch.equal(tensors[0], torch.ones(3)) and torch.equal(tensors[1], torch.arange(4.0).to(torch.bfloat16))
    model = _net()
    reducer = Reducer(model)
    grads = _grads(model)
    reducer.reduce()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


# -- two ranks ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return w.run_ranks("_apex_parallel_jobs:two_ranks", tmp_path_factory.mktemp("apex_parallel"), timeout=60)


def test_ddp_gradient_arithmetic_on_two_ranks(two):
    from _apex_parallel_jobs import DDP_CONFIGS

    local = two[0]["local"]
    total = [a + b for a, b in zip(*local)]
    expected = {0: [t / 2 for t in total], 1: total, 2: [t / 2 for t in total], 3: [t / 4 for t in total],
                4: [t / 2 for t in total]}
    for rank in two:
        for i, cfg in enumerate(DDP_CONFIGS):
            for got, want in zip(rank["ddp"][i], expected[i]):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m, cfg=cfg: f"{cfg}: {m}")


def test_flat_dist_call_averages_and_broadcasts_and_reducer_averages(two):
    r0, r1 = (r["flat"] for r in two)
    for r in (r0, r1):
        assert torch.equal(r["all_reduce"][0], torch.full((3,), 1.5))
        assert torch.equal(r["all_reduce"][1], torch.full((2, 2), 5.0, dtype=torch.bfloat16))
        assert torch.equal(r["broadcast"][0], torch.full((4,), 7.0))
    for a, b, g0, g1 in zip(r0["reduced"], r1["reduced"], r0["local"], r1["local"]):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, (g0 + g1) / 2)
    assert not torch.equal(r0["local"][0], r1["local"][0])  # different batches: the average is a real check


def test_cpu_sync_batchnorm_matches_one_batch_norm_over_both_ranks(two):
    """Outputs, running statistics and input grads equal those of plain BatchNorm on the concatenated batch."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3))
    s = [r["syncbn"] for r in two]
    x = torch.cat([r["x"] for r in s]).requires_grad_(True)
    y = net(x)
    (y * torch.cat([r["weights"] for r in s])).sum().backward()
    for i, r in enumerate(s):
        rows = slice(4 * i, 4 * i + 4)
        torch.testing.assert_close(r["y"], y[rows].detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["x_grad"], x.grad[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["running_mean"], net[1].running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["running_var"], net[1].running_var, rtol=1e-5, atol=1e-6)


# -- LARC -------------------------------------------------------------------------------------------------
def _larc_reference(p, g, lr, wd, trust, clip, eps=1e-8):
    """Apex's published LARC rule followed by plain SGD: p -= lr * local * (g + wd * p)."""
    pn, gn = float(p.norm()), float(g.norm())
    if pn == 0 or gn == 0:
        return p - lr * g
    local = trust * pn / (gn + pn * wd + eps)
    if clip:
        local = min(local / lr, 1.0)
    return p - lr * local * (g + wd * p)


@pytest.mark.parametrize("clip", [True, False])
def test_larc_under_o2_applies_its_rule_to_the_masters(clip):
    import amp_patch
    from amp_patch.legacy.apex.parallel.LARC import LARC

    model = _net()
    start = [p.detach().clone() for p in model.parameters()]
    opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.01), trust_coefficient=0.02, clip=clip)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert opt.optim.param_groups[0]["params"][0] is masters[0]  # the wrapped optimizer sees the masters too
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([m.grad.clone() for m in masters]))
    x = torch.randn(8, 4)
    for _ in range(5):
        with amp_patch.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    ref = start
    for grads in seen:
        ref = [_larc_reference(p, g, 0.1, 0.01, 0.02, clip) for p, g in zip(ref, grads)]
    for m, r in zip(masters, ref):
        torch.testing.assert_close(m.detach(), r, rtol=1e-6, atol=1e-7)
    assert opt.param_groups[0]["weight_decay"] == 0.01 and max(float((m.detach() - s).abs().max())
                                                               for m, s in zip(masters, start)) > 1e-5
