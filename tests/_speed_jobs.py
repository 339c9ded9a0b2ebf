"""Synthetic training jobs for the speed report (the experiment's job convention): one healthy, and one per
planted cause, each the healthy job with one change. Kept small for a shared CPU."""
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, TensorDataset

N, DIM, HIDDEN, CLASSES, BATCH = 512, 64, 512, 16, 64
SLOW_ITEM_S = 0.004  # per item: 256 ms per batch, far beyond the model's step (~100 ms in software bf16)


def _mlp():
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def _tensors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, DIM, generator=g)
    return x, (x @ torch.randn(DIM, CLASSES, generator=g)).argmax(dim=1)


def _batched_loader(batch=BATCH):
    """Whole batches indexed at once from the tensors: no per-item Python work."""
    data = TensorDataset(*_tensors())
    return DataLoader(data, batch_size=None, sampler=BatchSampler(RandomSampler(data), batch, drop_last=True))


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01)


def _ce(output, target):
    return F.cross_entropy(output.float(), target)


def healthy():
    return {"model_fn": _mlp, "optimizer_fn": _sgd, "data_fn": _batched_loader, "loss_fn": _ce, "name": "healthy"}


class SlowDataset(Dataset):
    """Each item takes SLOW_ITEM_S to build (decoding, augmenting: here a sleep)."""

    def __init__(self):
        self.x, self.y = _tensors()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        time.sleep(SLOW_ITEM_S)
        return self.x[index], self.y[index]


def _slow_loader():
    return DataLoader(SlowDataset(), batch_size=BATCH, shuffle=True, num_workers=0)


def slow_data():
    return dict(healthy(), data_fn=_slow_loader, name="slow_data")


def _slow_dataset():
    return SlowDataset()


def slow_dataset():
    """The same slow Dataset, returned as a Dataset (the report batches it as the experiment does)."""
    return dict(healthy(), data_fn=_slow_dataset, name="slow_dataset")


class ReadsLoss(nn.Module):
    """The healthy MLP, reading a value back on the host in every forward."""

    def __init__(self):
        super().__init__()
        self.net = _mlp()
        self.seen = 0.0

    def forward(self, x):
        out = self.net(x)
        self.seen += out.abs().mean().item()  # ITEM_LINE: a host read inside the step
        return out


ITEM_LINE = next(i for i, line in enumerate(open(__file__, encoding="utf-8"), 1) if "# ITEM_LINE" in line)


def item_in_forward():
    return dict(healthy(), model_fn=ReadsLoss, name="item_in_forward")


def _misaligned():
    return nn.Sequential(nn.Linear(DIM, 1001), nn.ReLU(), nn.Linear(1001, 999), nn.ReLU(), nn.Linear(999, CLASSES))


def _large_batches():
    return _batched_loader(256)  # the matmuls outweigh O1's per-step weight casts, as in real training


def misaligned():
    return dict(healthy(), model_fn=_misaligned, data_fn=_large_batches, name="misaligned")


class _BigParameter(nn.Module):
    """A 4M-element weight that a tiny forward barely uses (an embedding-like table)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(2048, 2048))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        return self.head(x) + self.table[0, :CLASSES]


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def heavy_optimizer():
    return dict(healthy(), model_fn=_BigParameter, optimizer_fn=_adam, name="heavy_optimizer")


class OddProjection(nn.Module):
    """The healthy MLP, then a matmul of its own with a 999-wide weight (no Linear layer to name)."""

    def __init__(self):
        super().__init__()
        self.net = _mlp()
        self.proj = nn.Parameter(torch.randn(CLASSES, 999) * 0.01)
        self.back = nn.Parameter(torch.randn(999, CLASSES) * 0.01)

    def forward(self, x):
        wide = torch.matmul(self.net(x), self.proj)  # MATMUL_LINE
        return torch.matmul(wide, self.back)


MATMUL_LINE = next(i for i, line in enumerate(open(__file__, encoding="utf-8"), 1) if "# MATMUL_LINE" in line)


def odd_matmul():
    return dict(healthy(), model_fn=OddProjection, data_fn=_large_batches, name="odd_matmul")


def _data_parallel():
    return nn.DataParallel(_mlp())


def data_parallel():
    return dict(healthy(), model_fn=_data_parallel, name="data_parallel")


class FailsWhileProbed(nn.Module):
    """The healthy MLP, raising in the first step the host-read probe watches (its patch of .item() is on)."""

    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x):
        if "item" in vars(torch.Tensor):
            raise RuntimeError("planted failure during a probe step")  # PROBE_RAISE_LINE
        return self.net(x)


def fails_while_probed():
    return dict(healthy(), model_fn=FailsWhileProbed, name="fails_while_probed")


def raises():
    return dict(healthy(), model_fn=_broken, name="raises")


def _broken():
    raise FileNotFoundError("no such checkpoint: ./weights.pt")
