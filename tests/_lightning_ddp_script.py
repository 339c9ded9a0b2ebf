"""Trainer(strategy="ddp", accelerator="cpu", devices=2) with AmpPatchPrecision; run by test_lightning.py.

Usage: python _lightning_ddp_script.py OUT_DIR OPT_LEVEL. Lightning re-runs this script for rank 1 (its
subprocess launcher). Each rank starts from its *own* random weights (DDP broadcasts rank 0's; the plugin must
give the fp32 masters rank 0's values too), accumulates 2 micro-batches per step (the first inside DDP's
no_sync) and rank 1 alone sees an inf loss in batch 2 (a no_sync micro-batch). Each rank saves what it saw.
"""
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning as L

import amp_patch
from amp_patch.lightning import AmpPatchPrecision

LINEAR = F.linear


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(10 + int(os.environ.get("LOCAL_RANK", "0")))
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.init = {k: v.clone() for k, v in self.state_dict().items()}
        self.records, self.losses = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y.float())
        self.losses.append(loss.item())
        return loss * math.inf if (self.global_rank == 1 and batch_idx == 2) else loss

    def on_train_start(self):
        self.start = {k: v.clone() for k, v in self.state_dict().items()}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        opt = self.trainer.optimizers[0]
        self.records.append((batch_idx, amp_patch.last_step_skipped(opt), amp_patch.loss_scale()))

    def on_train_end(self):
        half = {n: p.detach().clone() for n, p in self.named_parameters()}
        torch.save({"init": self.init, "start": self.start, "end": self.state_dict(), "half": half,
                    "records": self.records, "losses": self.losses},
                   os.path.join(sys.argv[1], f"rank{self.global_rank}.pt"))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=gen)
        return DataLoader(TensorDataset(x, x @ torch.randn(8, 1, generator=gen)), batch_size=4)


if __name__ == "__main__":
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=4, accumulate_grad_batches=2,
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, default_root_dir=sys.argv[1],
                        plugins=[AmpPatchPrecision(sys.argv[2], max_loss_scale=2.0 ** 12)])
    trainer.fit(Net())
    with open(os.path.join(sys.argv[1], f"after_fit{trainer.global_rank}.txt"), "w") as f:
        f.write(f"F.linear unpatched: {F.linear is LINEAR}\n")
