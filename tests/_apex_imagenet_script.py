"""A training script in the shape of NVIDIA Apex's examples/imagenet/main_amp.py, written for real Apex.

Its import block is the example's (every apex module in one ``try``, the "please install apex" exit on
ImportError); it uses apex.parallel.DistributedDataParallel(delay_allreduce=True) and convert_syncbn_model,
apex.optimizers.FusedSGD/FusedAdam, apex.fp16_utils.to_python_float, clips amp.master_params, checkpoints
with amp.state_dict(), and computes a gradient norm with amp_C through multi_tensor_applier and a checksum with
apex_C as NVIDIA's BERT scripts did. Tiny model, synthetic data, CPU (gloo) or CUDA (nccl).
Run by tests/integration/test_real_apex_scripts.py as ``amp-patch run`` (one process) and under
``torchrun --nproc_per_node=2``.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from apex import amp, optimizers
    from apex.fp16_utils import *  # noqa: F401,F403  (to_python_float)
    from apex.multi_tensor_apply import multi_tensor_applier
    from apex.parallel import DistributedDataParallel as DDP
except ImportError as exc:
    raise ImportError("Please install apex from https://www.github.com/nvidia/apex to run this example.") from exc
import amp_C
import apex_C


def parse():
    parser = argparse.ArgumentParser(description="Apex ImageNet-style training (synthetic data)")
    parser.add_argument("--opt-level", type=str)
    parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
    parser.add_argument("--loss-scale", type=str, default=None)
    parser.add_argument("--optimizer", choices=["fusedsgd", "fusedadam"], default="fusedsgd")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--clip", type=float, default=5.0)
    parser.add_argument("--sync_bn", action="store_true")
    parser.add_argument("--local_rank", default=int(os.environ.get("LOCAL_RANK", 0)), type=int)
    parser.add_argument("--checkpoint", default="", type=str, help="save here after the last step (rank 0)")
    parser.add_argument("--resume", default="", type=str, metavar="PATH")
    return parser.parse_args()


def make_model():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 4))


def batch(step, rank, batch_size):
    """Class c brightens channel c % 3 of quadrant c; each (step, rank) always gives the same batch."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    target = torch.randint(0, 4, (batch_size,), generator=gen)
    images = torch.randn(batch_size, 3, 8, 8, generator=gen) * 0.5
    for i, c in enumerate(target.tolist()):
        r, col = divmod(c, 2)
        images[i, c % 3, r * 4:(r + 1) * 4, col * 4:(col + 1) * 4] += 2.0
    return images, target


def reduce_tensor(tensor, world_size):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt / world_size


def main():
    args = parse()
    args.distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    args.world_size, rank = 1, 0
    if args.distributed:
        dist.init_process_group(backend="gloo", init_method="env://")
        args.world_size, rank = dist.get_world_size(), dist.get_rank()

    torch.manual_seed(0)
    model = make_model()
    if args.sync_bn:
        import apex
        print("using apex synced BN")
        model = apex.parallel.convert_syncbn_model(model)
    if args.optimizer == "fusedsgd":
        optimizer = optimizers.FusedSGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    else:
        optimizer = optimizers.FusedAdam(model.parameters(), lr=args.lr / 5, weight_decay=1e-4)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32, loss_scale=args.loss_scale)
    if args.distributed:
        model = DDP(model, delay_allreduce=True)  # after amp.initialize, as Apex required
    criterion = nn.CrossEntropyLoss()

    start = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        start = checkpoint["step"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        print(f"=> resumed from '{args.resume}' at step {start}")

    overflow_buf = torch.zeros(1, dtype=torch.int)
    model.train()
    for step in range(start, args.steps):
        images, target = batch(step, rank, args.batch_size)
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
        norm_amp_c, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)
        norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.clip)
        optimizer.step()
        reduced = reduce_tensor(loss.data, args.world_size) if args.distributed else loss.data
        if rank == 0:
            value, norm, norm_amp_c = (to_python_float(t) for t in (reduced, norm, norm_amp_c))  # noqa: F405
            print(f"step {step + 1} loss {value:.6f} grad norm {norm:.6f} amp_C {norm_amp_c:.6f}")

    if args.checkpoint and rank == 0:
        torch.save({"step": args.steps, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp": amp.state_dict()}, args.checkpoint)
    params = [p.detach().float() for p in amp.master_params(optimizer)]
    flat = apex_C.flatten(params)
    assert all(torch.equal(a, b) for a, b in zip(apex_C.unflatten(flat, params), params))
    print(f"rank {rank} checksum {flat.double().sum().item():.6f} dtypes "
          f"{sorted({str(p.dtype) for p in model.parameters()})}", flush=True)
    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
