"""Training jobs: the :class:`Job` convention, ``module:function`` loading, and the built-in synthetic jobs.

A job is four callables (plus an optional batch size and name):

- ``model_fn()`` returns an ``nn.Module`` (in float32; the runner moves it to the device),
- ``optimizer_fn(model)`` returns a ``torch.optim.Optimizer`` over the model's parameters,
- ``data_fn()`` returns the training data: a map-style ``Dataset`` (e.g. ``TensorDataset``) or a tuple of
  tensors (wrapped in a ``TensorDataset``); the runner batches it with a ``DataLoader``. Each item is
  ``(input, ..., target)``: the model is called as ``model(*item[:-1])``,
- ``loss_fn(output, target)`` returns the scalar loss.

``--job module:function`` names a function taking no arguments that returns such a job as a dict or an
object with those attributes (``batch_size`` and ``name`` optional). Every callable must be importable
(module-level) when variants run in their own processes.
"""
import dataclasses
import importlib

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError

_FIELDS = ("model_fn", "optimizer_fn", "data_fn", "loss_fn")


@dataclasses.dataclass
class Job:
    """One training job, run unchanged under every variant."""

    model_fn: object
    optimizer_fn: object
    data_fn: object
    loss_fn: object
    batch_size: int = 32
    name: str = "job"


def as_job(obj, name=None):
    """A :class:`Job` from a Job, a dict or an object with the job's attributes."""
    if isinstance(obj, Job):
        job = obj
    else:
        get = obj.get if isinstance(obj, dict) else (lambda key, default=None: getattr(obj, key, default))
        missing = [f for f in _FIELDS if get(f) is None]
        if missing:
            raise ConfigError(f"the job ({type(obj).__name__}) lacks {', '.join(missing)}; a job provides "
                              f"{', '.join(_FIELDS)} (see amp_patch.experiment.models)")
        job = Job(*(get(f) for f in _FIELDS), batch_size=get("batch_size", 32) or 32,
                  name=get("name", None) or name or "job")
    for field in _FIELDS:
        if not callable(getattr(job, field)):
            raise ConfigError(f"the job's {field} is {getattr(job, field)!r}, not a callable")
    if isinstance(job.batch_size, bool) or not isinstance(job.batch_size, int) or job.batch_size < 1:
        raise ConfigError(f"the job's batch_size is {job.batch_size!r}; pass a positive integer")
    return job


def load_job(spec):
    """Import ``module:function`` and call the function to get its :class:`Job`."""
    module_name, sep, func_name = str(spec).partition(":")
    if not sep or not module_name or not func_name:
        raise ConfigError(f"--job {spec!r}; expected module:function, e.g. mypkg.jobs:make_job")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--job {spec!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?") from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"--job {spec!r}: {module_name} has no callable {func_name!r}")
    return as_job(func(), name=func_name)


# --- built-in jobs on synthetic data ---------------------------------------------------------------------

def _mlp_model():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def _mlp_data():
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 64, generator=gen)
    teacher = torch.randn(64, 10, generator=gen)
    return x, (x @ teacher).argmax(dim=1)


def _cross_entropy(output, target):
    return F.cross_entropy(output, target)  # looked up per call, so O1's patch of F.cross_entropy applies


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def mlp():
    """A 3-layer MLP (64-128-128-10) learning a random linear teacher; SGD with momentum."""
    return Job(_mlp_model, _sgd, _mlp_data, _cross_entropy, batch_size=32, name="mlp")


def _cnn_model():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def _cnn_data():
    gen = torch.Generator().manual_seed(1234)
    images = torch.randn(256, 3, 16, 16, generator=gen)
    labels = torch.randint(0, 10, (256,), generator=gen)
    images += labels.view(-1, 1, 1, 1).float() / 5.0  # a learnable signal: brightness encodes the label
    return images, labels


def cnn():
    """A small CNN (2 conv + batchnorm layers, 3x16x16 images, 10 classes); SGD with momentum."""
    return Job(_cnn_model, _sgd, _cnn_data, _cross_entropy, batch_size=16, name="cnn")


_VOCAB, _SEQ = 64, 16


class TinyTransformer(nn.Module):
    """Embedding, one TransformerEncoder layer (d32, 2 heads) and a vocabulary head."""

    def __init__(self, vocab=_VOCAB, d_model=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(_SEQ, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.pos)).flatten(0, 1)


def _transformer_data():
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, _VOCAB, (128, _SEQ), generator=gen)
    return tokens, (tokens + 1) % _VOCAB


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3)


def _token_loss(output, target):
    return F.cross_entropy(output, target.flatten())


def transformer():
    """A tiny transformer (d32, 1 layer, seq 16) learning to predict token+1; AdamW."""
    return Job(TinyTransformer, _adamw, _transformer_data, _token_loss, batch_size=8, name="transformer")


BUILTIN = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def builtin_spec(name):
    """The ``module:function`` spec of a built-in job (what a spawned variant process imports)."""
    if name not in BUILTIN:
        raise ConfigError(f"--model {name!r}; allowed: {', '.join(BUILTIN)}")
    return f"{__name__}:{name}"
