"""Distributed data-parallel training with amp_patch: DistributedSampler, no_sync accumulation, checkpoint/resume.

    torchrun --nproc_per_node=2 examples/ddp_train.py --opt-level O2
    torchrun --nproc_per_node=2 examples/ddp_train.py --opt-level O2 --steps 40 --resume   # continue

Runs on CPU with gloo (e.g. 2 processes on a laptop) or on GPUs with NCCL (one
process per GPU). Also runs without torchrun as a single process. See
docs/distributed.md for why each line is where it is.
"""
import argparse
import contextlib
import gc
import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import amp_patch


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3"])
    p.add_argument("--half-dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to reach (counting resumed ones)")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--batch-size", type=int, default=8, help="samples per micro-batch per rank")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--samples", type=int, default=512, help="size of the synthetic data set")
    p.add_argument("--ckpt-dir", default="ddp_checkpoints")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N optimizer steps (and at the end)")
    p.add_argument("--resume", action="store_true", help="continue from <ckpt-dir>/last.pt if it exists")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def setup():
    """Join the process group torchrun describes (or a 1-process group); pick this rank's device."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group(backend)
    return device


def synthetic_data(n, seed):
    """Same data on every rank (the sampler splits it): a noisy random two-layer teacher."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, 16, generator=g)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        y = teacher(x) + 0.01 * torch.randn(n, 4, generator=g)
    return TensorDataset(x, y)


def build_model(seed):
    torch.manual_seed(seed)  # same init on every rank (DDP would broadcast rank 0's anyway; O2 masters would not)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


def save_checkpoint(path, model, optimizer, step, args):
    """Rank 0 writes atomically; the model's state_dict holds the fp32 master values under O2."""
    if dist.get_rank() == 0:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp_patch.state_dict(),
                 "step": step, "opt_level": args.opt_level}
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()  # nobody resumes from (or deletes) a half-written file


def load_checkpoint(path, model, optimizer, device):
    """Every rank loads the same file, after initialize and before DDP (masters included)."""
    state = torch.load(path, map_location=device, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    amp_patch.load_state_dict(state["amp"])
    return state["step"]


def main(argv=None):
    args = parse_args(argv)
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s")
    try:
        train(args, device, rank, world)
    finally:
        amp_patch.deinitialize()
        gc.collect()  # free the DDP module (it sits in reference cycles) before its process group goes away
        dist.destroy_process_group()


def train(args, device, rank, world):
    model = build_model(args.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # 1. initialize the bare model (amp_patch raises if it is already wrapped in DDP) ...
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level=args.opt_level,
                                            half_dtype=getattr(torch, args.half_dtype))
    # 2. ... restore a checkpoint into the bare model (every rank reads the same file) ...
    ckpt = os.path.join(args.ckpt_dir, "last.pt")
    step = 0
    if args.resume and os.path.exists(ckpt):
        step = load_checkpoint(ckpt, model, optimizer, device)
        if rank == 0:
            print(f"resumed from step {step} ({ckpt})", flush=True)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    # 3. ... then wrap it. Under O2, DDP all-reduces the half gradients; amp_patch unscales them into fp32 masters.
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    data = synthetic_data(args.samples, args.seed)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader) // args.accum
    if steps_per_epoch == 0:
        raise SystemExit("not enough data for one optimizer step: lower --accum/--batch-size or raise --samples")

    loss_sum, loss_count = torch.zeros((), device=device), 0
    while step < args.steps:
        epoch, skip = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)  # a new shuffle per epoch, the same on every rank
        batches = iter(loader)
        for _ in range(skip * args.accum):  # a resumed epoch continues where the checkpoint left it
            next(batches)
        for _ in range(skip, steps_per_epoch):
            if step >= args.steps:
                break
            for micro in range(args.accum):
                x, y = (t.to(device, non_blocking=True) for t in next(batches))
                last = micro == args.accum - 1
                # Gradients of the first accum-1 micro-batches stay local (no all-reduce) and stay *scaled*
                # (delay_unscale=True): DDP reduces the whole accumulated sum on the last backward, and amp_patch
                # unscales it once, deciding the overflow for all ranks together.
                sync = contextlib.nullcontext() if last else ddp.no_sync()
                with sync:
                    loss = F.mse_loss(ddp(x).float(), y) / args.accum
                    with amp_patch.scale_loss(loss, optimizer, delay_unscale=not last) as scaled:
                        scaled.backward()
                loss_sum += loss.detach()
            torch.nn.utils.clip_grad_norm_(amp_patch.master_params(optimizer), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_count += 1
            if step % args.save_every == 0 or step == args.steps:
                dist.all_reduce(loss_sum)
                if rank == 0:
                    skipped = " (step skipped: overflow)" if amp_patch.last_step_skipped(optimizer) else ""
                    print(f"step {step}: loss {loss_sum.item() / (loss_count * world):.5f}, "
                          f"loss scale {amp_patch.loss_scale():g}{skipped}", flush=True)
                loss_sum.zero_()
                loss_count = 0
                save_checkpoint(ckpt, model, optimizer, step, args)
    report_sync(model, optimizer)


def report_sync(model, optimizer):
    """Check that every rank holds the same weights (a sum of the master params, compared by MIN/MAX)."""
    total = torch.stack([p.detach().double().sum() for p in amp_patch.master_params(optimizer)]).sum()
    lo, hi = total.clone(), total.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"ranks in sync: {bool(lo == hi)} (master checksum {total.item():.10f})", flush=True)


if __name__ == "__main__":
    main()
