"""Per-rank job for tests/integration/test_apex_parallel.py (run through _dist_worker.run_ranks as
``"_apex_parallel_jobs:two_ranks"``). Every rank also computes, without any collective, what the other rank's
local gradients/batches are, so the parent test can compare against plain sums and means."""

import torch
import torch.distributed as dist

from amp_patch.legacy.apex.parallel import DistributedDataParallel, Reducer, convert_syncbn_model
from amp_patch.legacy.apex.parallel.distributed import flat_dist_call

DDP_CONFIGS = [dict(), dict(gradient_average=False), dict(gradient_predivide_factor=2.0),
               dict(gradient_average=False, gradient_predivide_factor=4.0), dict(allreduce_always_fp32=True)]


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(5, 4, generator=g)


def _grads(model, x):
    model(x).pow(2).sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _ddp_grads(rank):
    out = []
    for cfg in DDP_CONFIGS:
        ddp = DistributedDataParallel(_linear(), **cfg)
        out.append(_grads(ddp, _batch(rank)))
        del ddp
    return out


def _flat_calls(rank):
    tensors = [torch.full((3,), float(rank + 1)), torch.full((2, 2), float(10 * rank), dtype=torch.bfloat16)]
    flat_dist_call(tensors, dist.all_reduce)
    sent = [torch.full((4,), float(rank + 7))]
    flat_dist_call(sent, dist.broadcast, (0,))
    model = _linear()
    if rank == 1:
        with torch.no_grad():
            model.weight.add_(1.0)
    reducer = Reducer(model)
    grads = _grads(model, _batch(rank))
    reducer.reduce()
    return {"all_reduce": tensors, "broadcast": sent, "reduced": [p.grad for p in model.parameters()],
            "local": grads}


def _syncbn(rank):
    torch.manual_seed(0)
    net = convert_syncbn_model(torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3)))
    g = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(4, 2, 3, 3, generator=g, requires_grad=True)
    weights = torch.randn(4, 3, 3, 3, generator=g)
    y = net(x)
    (y * weights).sum().backward()
    bn = net[1]
    return {"x": x.detach(), "weights": weights, "y": y.detach(), "x_grad": x.grad, "running_mean": bn.running_mean,
            "running_var": bn.running_var, "bn_weight_grad": bn.weight.grad}


def two_ranks(rank, world):
    local = [_grads(_linear(), _batch(r)) for r in range(world)]
    return {"ddp": _ddp_grads(rank), "local": local, "flat": _flat_calls(rank), "syncbn": _syncbn(rank)}
