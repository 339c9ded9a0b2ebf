"""Synthetic training jobs for the precision doctor (the experiment's job convention), kept tiny for CPU."""
import torch
from torch import nn
from torch.nn import functional as F

N, SEQ, DIM, CLASSES = 64, 4, 8, 4


class Attention(nn.Module):
    """Single-head attention whose q·kᵀ logits are far beyond float16's range (the inputs are large)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        scores = torch.bmm(q, k.transpose(1, 2)) / 1e6
        return torch.bmm(torch.softmax(scores, dim=-1), self.v(x))


class AttentionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.attn = Attention()
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.attn(h * 1000.0).mean(dim=1) / 1000.0 + h.mean(dim=1))


def _classification(seed, inputs):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, *inputs, generator=g)
    w = torch.randn(inputs[-1], CLASSES, generator=g)
    feats = x.mean(dim=1) if x.dim() == 3 else x
    return x, (feats @ w).argmax(dim=-1)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


def _ce(out, target):
    return F.cross_entropy(out.float(), target)


def attention_data():
    return _classification(0, (SEQ, DIM))


def attention_job():
    return {"model_fn": AttentionNet, "optimizer_fn": _sgd, "data_fn": attention_data, "loss_fn": _ce,
            "batch_size": 16, "name": "attention"}


class SumPool(nn.Module):
    """A custom reduction: the sum over features written as a matmul with a ones vector (overflows in fp16)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ones", torch.ones(64, 1))

    def forward(self, h):
        return torch.matmul(h, self.ones) / 64.0


class ReductionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 64)
        self.pool = SumPool()
        self.head = nn.Linear(1, CLASSES)

    def forward(self, x):
        h = torch.relu(self.up(x)) * 6000.0
        return self.head(self.pool(h) / 6000.0)


def reduction_job():
    return {"model_fn": ReductionNet, "optimizer_fn": _sgd, "data_fn": lambda_free_mlp_data, "loss_fn": _ce,
            "batch_size": 16, "name": "reduction"}


def lambda_free_mlp_data():
    return _classification(1, (DIM,))


def mlp_model():
    return nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, CLASSES))


def mlp_job():
    return {"model_fn": mlp_model, "optimizer_fn": _sgd, "data_fn": lambda_free_mlp_data, "loss_fn": _ce,
            "batch_size": 16, "name": "mlp"}


def nan_data():
    x, y = _classification(2, (DIM,))
    x[::3] = float("nan")  # every third sample is corrupt: most batches hold one
    return x, y


def nan_data_job():
    return {"model_fn": mlp_model, "optimizer_fn": _sgd, "data_fn": nan_data, "loss_fn": _ce,
            "batch_size": 16, "name": "nan_data"}


class SmallHead(nn.Module):
    """A classifier over features beyond float16's range: F.linear (half) casts them to inf."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(CLASSES, 16) * 0.1)

    def forward(self, e):
        return F.linear(e, self.weight * 1e-5)


class ExpFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, 16)
        self.head = SmallHead()

    def forward(self, x):
        return self.head(torch.exp(self.lin(x) * 0.1 + 12.0))  # exp runs in float32: about e**12 = 1.6e5


def cast_job():
    return {"model_fn": ExpFeatures, "optimizer_fn": _sgd, "data_fn": lambda_free_mlp_data, "loss_fn": _ce,
            "batch_size": 16, "name": "cast"}


class LogOfZero(nn.Module):
    """log of a ReLU output: -inf wherever the unit is off, in any precision."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        return torch.log(torch.relu(self.lin(x)))


def log_zero_job():
    return {"model_fn": LogOfZero, "optimizer_fn": _sgd, "data_fn": lambda_free_mlp_data, "loss_fn": _ce,
            "batch_size": 16, "name": "log_zero"}


class Layered(nn.Module):
    """Three attention layers; the ``hot`` ones see inputs whose q·kᵀ leaves float16's range."""

    hot = (0, 1, 2)

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([Attention() for _ in range(3)])
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            gain = 1000.0 if i in self.hot else 1.0
            h = h + block(h * gain) / gain
        return self.head(h.mean(dim=1))


class LayeredOneHot(Layered):
    hot = (1,)


def layered_job():
    return {"model_fn": Layered, "optimizer_fn": _sgd, "data_fn": attention_data, "loss_fn": _ce,
            "batch_size": 16, "name": "layered"}


def layered_one_hot_job():
    return {"model_fn": LayeredOneHot, "optimizer_fn": _sgd, "data_fn": attention_data, "loss_fn": _ce,
            "batch_size": 16, "name": "layered_one_hot"}


def _summed_ce(out, target):
    return F.cross_entropy(out.float(), target) * 70.0  # a summed loss: its gradients are 70x the mean's


def healthy_backoff_job():
    """A healthy float16 MLP whose gradients do not fit the scaler's initial 65536: it backs off 4 times before
    the first applied step (65536 -> 4096) and once more at step 5, then trains."""
    return {"model_fn": mlp_model, "optimizer_fn": _sgd, "data_fn": lambda_free_mlp_data, "loss_fn": _summed_ce,
            "batch_size": 16, "name": "healthy_backoff"}
