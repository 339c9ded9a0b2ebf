"""Distributed data parallel training with Apex amp (amp.initialize before DistributedDataParallel).

Written for NVIDIA Apex and left that way: run it unmodified with
    torchrun --nproc_per_node=2 -m amp_patch run examples/legacy/ddp_amp.py --opt-level O1
(gloo backend, CPU). Each rank trains on its own shard of a synthetic regression problem; at the end every
rank prints a checksum of its weights, which must agree across ranks.
"""
import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from apex import amp
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
parser.add_argument("--opt-level", type=str, default="O1")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.05)
args = parser.parse_args()

args.distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
if args.distributed:
    dist.init_process_group(backend="gloo", init_method="env://")
    world_size, rank = dist.get_world_size(), dist.get_rank()
else:
    world_size, rank = 1, 0

torch.manual_seed(0)  # the same initial weights on every rank
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

# amp.initialize must come before wrapping the model in DDP
model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
if args.distributed:
    model = DDP(model)

true_w = torch.linspace(-1, 1, 8)
gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard
for step in range(args.steps):
    x = torch.randn(args.batch_size, 8, generator=gen)
    y = (x @ true_w).unsqueeze(1)
    output = model(x)
    loss = nn.functional.mse_loss(output.float(), y)
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    reduced = loss.detach().clone()
    if args.distributed:
        dist.all_reduce(reduced)
        reduced /= world_size
    if rank == 0:
        print(f"step {step + 1} loss {reduced.item():.6f}", flush=True)

checksum = sum(p.detach().double().sum().item() for p in amp.master_params(optimizer))
print(f"rank {rank} checksum {checksum:.10f}", flush=True)
if args.distributed:
    del model  # free the DDP module (it sits in reference cycles) before its process group goes away,
    gc.collect()  # or torch 2.x with gloo can abort at exit ("terminate called without an active exception")
    dist.destroy_process_group()
