"""Bytes per parameter per rank: DDP O2 vs amp_patch.fully_shard + O2 (FSDP2), 2 gloo ranks on CPU, one run.

Counted from tensor storages after one training step (backward, optimizer.step(), before zero_grad): the
model's params and grads, the optimizer's params (O2's fp32 masters under DDP) and their grads, and the optimizer
state (Adam: exp_avg, exp_avg_sq, step). A storage is counted once, with its whole size (FSDP2's padding
included); a DTensor counts its local shard. Divided by the model's full parameter count. Not counted: DDP's
gradient buckets and FSDP2's transient unsharded half params/grads (freed per block), which are not reachable
as tensors from the model or the optimizer.

    python benchmarks/bench_fsdp2.py [--width 512] [--blocks 4]
"""
import argparse
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import amp_patch  # noqa: E402

CATEGORIES = ("params fp16", "params fp32", "grads fp16", "grads fp32", "optimizer state")


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(width, width), torch.nn.LayerNorm(width)

    def forward(self, x):
        return x + F.relu(self.norm(self.linear(x)))


def make_model(width, blocks):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(width) for _ in range(blocks)], torch.nn.Linear(width, 8))


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def count(model, opt):
    """{category: bytes} of the distinct storages this rank holds (params: the model's and the optimizer's)."""
    seen, out = set(), dict.fromkeys(CATEGORIES, 0)

    def add(role, tensor):
        if tensor is None:
            return
        storage = _local(tensor).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            key = role if role == "optimizer state" else f"{role} {str(tensor.dtype).replace('torch.float', 'fp')}"
            out[key] += storage.nbytes()

    for p in list(model.parameters()) + list(amp_patch.master_params(opt)):
        add("params", p)
        add("grads", p.grad)
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add("optimizer state", value)
    return out


def train_one_step(model, opt, width):
    x, y = torch.randn(4, width), torch.randn(4, 8)
    loss = F.mse_loss(model(x).float(), y)
    with amp_patch.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    if amp_patch.last_step_skipped(opt):
        raise RuntimeError("the measured step was skipped (overflow): no grads or optimizer state to count")


def ddp_o2(width, blocks):
    model = make_model(width, blocks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", keep_fp32_modules=(torch.nn.LayerNorm,),
                                      loss_scale=128.0, verbosity=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    try:
        train_one_step(ddp, opt, width)
        return count(model, opt), sum(p.numel() for p in model.parameters())
    finally:
        amp_patch.deinitialize()
        del ddp


def fsdp2_o2(width, blocks):
    model = make_model(width, blocks)
    amp_patch.fully_shard(model, opt_level="O2", keep_fp32_modules=(torch.nn.LayerNorm,), wrap=Block)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", keep_fp32_modules=(torch.nn.LayerNorm,),
                                      loss_scale=128.0, verbosity=0)
    try:
        train_one_step(model, opt, width)
        return count(model, opt)
    finally:
        amp_patch.deinitialize()


def worker(rank, world, store, args, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        ddp, numel = ddp_o2(args.width, args.blocks)
        fsdp = fsdp2_o2(args.width, args.blocks)
        dist.barrier()
    finally:
        import gc
        gc.collect()
        dist.destroy_process_group()
    results[rank] = (ddp, fsdp, numel)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    world = 2
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(world, os.path.join(tmp, "store"), args, results), nprocs=world)
        results = dict(results)
    numel = results[0][2]
    print(f"{numel} parameters ({args.blocks} blocks of Linear({args.width}) + LayerNorm, fp16), {world} gloo "
          "ranks; bytes per parameter per rank after one step (Adam)")
    print("| held per rank | " + " | ".join(f"DDP O2 rank {r} | FSDP2 O2 rank {r}" for r in range(world)) + " |")
    print("|---|" + "---|---|" * world)
    for category in CATEGORIES + ("total",):
        cells = []
        for r in range(world):
            ddp, fsdp, _ = results[r]
            pick = (lambda d: sum(d.values())) if category == "total" else (lambda d, category=category: d[category])
            cells += [f"{pick(ddp) / numel:.2f}", f"{pick(fsdp) / numel:.2f}"]
        print(f"| {category} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
