"""Image classification with Apex amp, in the style of Apex's ImageNet example (main_amp.py).

Written for NVIDIA Apex and left that way: run it unmodified with
    amp-patch run examples/legacy/imagenet_amp.py --opt-level O2 --steps 20
A small CNN on synthetic images (a deterministic batch per step) on the CPU, or CUDA with --cuda.
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from apex import amp


def parse():
    parser = argparse.ArgumentParser(description="Apex amp image classification (synthetic data)")
    parser.add_argument("--opt-level", type=str, default="O1")
    parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
    parser.add_argument("--loss-scale", type=str, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("-b", "--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", type=str, default=None, help="save a checkpoint here after the last step")
    parser.add_argument("--resume", action="store_true", help="start from --checkpoint")
    parser.add_argument("--cuda", action="store_true")
    return parser.parse_args()


class SmallNet(nn.Module):
    def __init__(self, num_classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 4, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.adaptive_avg_pool2d(x, 2).flatten(1)
        return self.fc(x)


def synthetic_batch(step, batch_size, seed, device):
    """Class c brightens quadrant c of a noisy 16x16 image; the same step always gives the same batch."""
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    target = torch.randint(0, 4, (batch_size,), generator=gen)
    images = torch.randn(batch_size, 3, 16, 16, generator=gen) * 0.5
    for i, c in enumerate(target.tolist()):
        r, col = divmod(c, 2)
        images[i, :, r * 8:(r + 1) * 8, col * 8:(col + 1) * 8] += 3.0
    return images.to(device), target.to(device)


def main():
    args = parse()
    device = torch.device("cuda" if args.cuda else "cpu")
    torch.manual_seed(args.seed)
    model = SmallNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32, loss_scale=args.loss_scale)
    criterion = nn.CrossEntropyLoss().to(device)

    start_step = 0
    if args.resume:
        if not args.checkpoint or not os.path.isfile(args.checkpoint):
            raise SystemExit(f"=> no checkpoint found at '{args.checkpoint}'")
        checkpoint = torch.load(args.checkpoint, map_location=device)
        start_step = checkpoint["step"]
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        print(f"=> resumed from '{args.checkpoint}' at step {start_step}")

    model.train()
    for step in range(start_step, args.steps):
        images, target = synthetic_batch(step, args.batch_size, args.seed, device)
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
        print(f"step {step + 1} loss {loss.item():.6f} loss_scale {scale}")

    if args.checkpoint and not args.resume:
        torch.save({"step": args.steps, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp": amp.state_dict()}, args.checkpoint)
        print(f"=> saved checkpoint '{args.checkpoint}'")


if __name__ == "__main__":
    main()
