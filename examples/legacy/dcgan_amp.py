"""A GAN with two optimizers and three losses under Apex amp, in the style of Apex's DCGAN example.

Written for NVIDIA Apex and left that way: run it unmodified with
    amp-patch run examples/legacy/dcgan_amp.py --opt_level O1 --niter 20
The discriminator's real and fake losses and the generator's loss each get their own loss scaler
(num_losses=3, loss_id=0/1/2). Tiny MLPs learn to generate 2-D points around (2, -1) on the CPU.
"""
import argparse

import torch
import torch.nn as nn
from apex import amp

parser = argparse.ArgumentParser()
parser.add_argument("--batchSize", type=int, default=64)
parser.add_argument("--nz", type=int, default=4, help="size of the latent z vector")
parser.add_argument("--niter", type=int, default=20, help="number of training steps")
parser.add_argument("--lrD", type=float, default=0.01)
parser.add_argument("--lrG", type=float, default=0.002)
parser.add_argument("--beta1", type=float, default=0.5)
parser.add_argument("--manualSeed", type=int, default=0)
parser.add_argument("--opt_level", default="O1", help="O0, O1, O2 or O3")
opt = parser.parse_args()

torch.manual_seed(opt.manualSeed)
device = torch.device("cpu")
REAL_MEAN = torch.tensor([2.0, -1.0])


class Generator(nn.Module):
    def __init__(self, nz):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(nz, 32), nn.ReLU(True), nn.Linear(32, 2))

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 1))

    def forward(self, x):
        return self.main(x).view(-1)  # logits: BCEWithLogitsLoss, as amp requires


netG = Generator(opt.nz).to(device)
netD = Discriminator().to(device)
criterion = nn.BCEWithLogitsLoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=opt.lrD, betas=(opt.beta1, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=opt.lrG, betas=(opt.beta1, 0.999))

[netD, netG], [optimizerD, optimizerG] = amp.initialize(
    [netD, netG], [optimizerD, optimizerG], opt_level=opt.opt_level, num_losses=3)

real_label, fake_label = 1.0, 0.0
for i in range(opt.niter):
    # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
    netD.zero_grad()
    real = REAL_MEAN + 0.1 * torch.randn(opt.batchSize, 2, device=device)
    label = torch.full((opt.batchSize,), real_label, device=device)
    output = netD(real)
    errD_real = criterion(output, label)
    with amp.scale_loss(errD_real, optimizerD, loss_id=0) as errD_real_scaled:
        errD_real_scaled.backward()

    noise = torch.randn(opt.batchSize, opt.nz, device=device)
    fake = netG(noise)
    label.fill_(fake_label)
    output = netD(fake.detach())
    errD_fake = criterion(output, label)
    with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as errD_fake_scaled:
        errD_fake_scaled.backward()
    errD = errD_real + errD_fake
    optimizerD.step()

    # (2) Update G: maximize log(D(G(z)))
    netG.zero_grad()
    label.fill_(real_label)
    output = netD(fake)
    errG = criterion(output, label)
    with amp.scale_loss(errG, optimizerG, loss_id=2) as errG_scaled:
        errG_scaled.backward()
    optimizerG.step()

    print(f"[{i + 1}/{opt.niter}] Loss_D: {errD.item():.4f} Loss_G: {errG.item():.4f} "
          f"fake_mean: {fake.float().mean(0).tolist()}")
