"""Per-rank jobs for tests/integration/test_apex_ddp_ranks.py (run through
``_dist_worker.run_ranks("_apex_dist_jobs:job", ...)``).

NVIDIA's BERT pre-training seeds each rank differently before building the model, initializes O2 and then wraps
in DDP: the ranks must still train identical weights (Apex made its masters after DDP's broadcast)."""
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import amp_patch
from amp_patch.legacy import amp
from amp_patch.legacy.apex.parallel import DistributedDataParallel as ApexDDP


def per_rank_seeds(rank, world):
    out = {}
    for wrapper in ("torch", "apex"):
        torch.manual_seed(1000 + rank)  # a different seed per rank, as the BERT script does
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
        try:
            ddp = DDP(model) if wrapper == "torch" else ApexDDP(model)
            g = torch.Generator().manual_seed(rank)  # each rank its own data
            for _ in range(3):
                x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
                for p in model.parameters():
                    p.grad = None
                with amp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
                    scaled.backward()
                opt.step()
            out[wrapper] = {"params": [p.detach().clone() for p in model.parameters()],
                            "masters": [p.detach().clone() for p in amp.master_params(opt)],
                            "momentum": [opt.state[p]["momentum_buffer"].clone() for p in amp.master_params(opt)]}
        finally:
            amp_patch.deinitialize()
            del ddp
    return out


def syncbn_plain_ddp(rank, world):
    """apex.parallel.convert_syncbn_model, then plain torch DDP on CPU (gloo): torch refuses its own SyncBatchNorm
    there; Apex's (a _BatchNorm) is accepted and all-reduces its statistics."""
    from amp_patch.legacy.apex.parallel import convert_syncbn_model

    torch.manual_seed(0)
    model = convert_syncbn_model(torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3)))
    ddp = DDP(model)
    x = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(rank))
    out = ddp(x)
    out.sum().backward()
    return {"running_mean": model[1].running_mean.clone(), "grad": model[0].weight.grad.clone()}


def masters_and_syncbn(rank, world):
    return {"seeds": per_rank_seeds(rank, world), "syncbn": syncbn_plain_ddp(rank, world)}
