"""Trainer(strategy="ddp", accelerator="cpu", devices=2) with AmpPatchPrecision; run by test_lightning.py.

Usage: python _lightning_ddp_script.py OUT_DIR OPT_LEVEL trainer|fabric. Lightning re-runs this script for rank 1
(its subprocess launcher). Each rank starts from its *own* random weights (DDP broadcasts rank 0's; the plugin must
give the fp32 masters rank 0's values too), accumulates 2 micro-batches per step (the first inside DDP's
no_sync) and rank 1 alone sees an inf loss in batch 2 (a no_sync micro-batch). Each rank saves what it saw.
"""
import math
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import amp_patch
from amp_patch.integrations.lightning import AmpPatchFabricPrecision, AmpPatchPrecision

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


def trainer_main(out, level):
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=4, accumulate_grad_batches=2,
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, default_root_dir=out,
                        plugins=[AmpPatchPrecision(level, max_loss_scale=2.0 ** 12)])
    trainer.fit(Net())
    return trainer.global_rank


def fabric_main(out, level):
    """The same run as a Fabric loop: no_backward_sync for the first micro-batch, fabric.backward(model=...)."""
    precision = AmpPatchFabricPrecision(level, max_loss_scale=2.0 ** 12)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=precision)
    fabric.launch()
    rank = fabric.global_rank
    net = Net()  # its own weights per rank, as above
    model, opt = fabric.setup(net.net, torch.optim.SGD(net.net.parameters(), lr=0.05, momentum=0.9))
    batches = list(net.train_dataloader())[rank::2]
    records = []
    for step in range(4):
        for micro in range(2):
            x, y = batches[2 * step + micro]
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = F.mse_loss(model(x).float(), y)
                fabric.backward(loss * math.inf if (rank == 1 and step == 1 and micro == 0) else loss, model=model)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        records.append((2 * step + 1, amp_patch.last_step_skipped(opt.optimizer), amp_patch.loss_scale()))
    half = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    init = {k.removeprefix("net."): v for k, v in net.init.items()}
    torch.save({"init": init, "end": model.state_dict(), "half": half, "records": records},
               os.path.join(out, f"rank{rank}.pt"))
    precision.teardown()
    return rank


if __name__ == "__main__":
    main = fabric_main if sys.argv[3] == "fabric" else trainer_main
    rank = main(sys.argv[1], sys.argv[2])
    with open(os.path.join(sys.argv[1], f"after_fit{rank}.txt"), "w") as f:
        f.write(f"F.linear unpatched: {F.linear is LINEAR}\n")
