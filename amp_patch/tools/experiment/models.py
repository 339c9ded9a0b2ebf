"""Training jobs: the :class:`Job` convention, ``module:function`` loading, and the built-in synthetic jobs.

A job is four callables (plus an optional batch size and name):

- ``model_fn()`` returns an ``nn.Module`` (in float32; the runner moves it to the device),
- ``optimizer_fn(model)`` returns a ``torch.optim.Optimizer`` over the model's parameters,
- ``data_fn()`` returns the training data: a map-style ``Dataset`` (e.g. ``TensorDataset``) or a tuple of
  tensors (wrapped in a ``TensorDataset``); the runner batches it with a ``DataLoader``. Each item is
  ``(input, ..., target)``: the model is called as ``model(*item[:-1])``,
- ``loss_fn(output, target)`` returns the scalar loss.

``--job module:function`` names a function taking no arguments that returns such a job as a dict or an
object with those attributes (``batch_size`` and ``name`` optional; without a name the job is named after the
function). Every callable must be importable
(module-level) when variants run in their own processes.
"""
import dataclasses
import importlib
import importlib.util
import os
import sys
import sysconfig
import traceback

import torch
from torch import nn
from torch.nn import functional as F

from ...errors import ConfigError, JobError

_FIELDS = ("model_fn", "optimizer_fn", "data_fn", "loss_fn")
#: a Job's name when none is given; a job loaded from ``module:function`` is then named after the function
DEFAULT_NAME = "job"


@dataclasses.dataclass
class Job:
    """One training job, run unchanged under every variant."""

    model_fn: object
    optimizer_fn: object
    data_fn: object
    loss_fn: object
    batch_size: int = 32
    name: str = DEFAULT_NAME
    #: op lists (shipped names or YAML files) to run O1 with, one ``O1 [list]`` variant each; () : O1's default
    op_lists: tuple = ()


def as_job(obj, name=None):
    """A :class:`Job` from a Job, a dict or an object with the job's attributes; ``name`` names it when it
    gives no name of its own (a Job left at :data:`DEFAULT_NAME`)."""
    if isinstance(obj, Job):
        job = obj if name is None or obj.name != DEFAULT_NAME else dataclasses.replace(obj, name=name)
    else:
        get = obj.get if isinstance(obj, dict) else (lambda key, default=None: getattr(obj, key, default))
        missing = [f for f in _FIELDS if get(f) is None]
        if missing:
            raise ConfigError(f"the job ({type(obj).__name__}) lacks {', '.join(missing)}; a job provides "
                              f"{', '.join(_FIELDS)} (see amp_patch.tools.experiment.models)")
        job = Job(*(get(f) for f in _FIELDS), batch_size=get("batch_size", 32) or 32,
                  name=get("name", None) or name or DEFAULT_NAME, op_lists=get("op_lists", None) or ())
    for field in _FIELDS:
        if not callable(getattr(job, field)):
            raise ConfigError(f"the job's {field} is {getattr(job, field)!r}, not a callable")
    if isinstance(job.batch_size, bool) or not isinstance(job.batch_size, int) or job.batch_size < 1:
        raise ConfigError(f"the job's batch_size is {job.batch_size!r}; pass a positive integer")
    return job


def load_job(spec):
    """The :class:`Job` of ``module:function`` (the module found from the current directory first, then
    ``sys.path``, as ``python -m`` does) or ``path/to/file.py:function``. A function that raises is a
    :class:`~amp_patch.errors.JobError` naming the job, the exception and the user's ``file:line``."""
    module_name, sep, func_name = str(spec).rpartition(":")
    if not sep or not module_name or not func_name:
        raise ConfigError(f"--job {spec!r}; expected module:function or path/to/file.py:function, "
                          "e.g. mypkg.jobs:make_job or ./jobs.py:make_job")
    module = _import_job_module(spec, module_name)
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"--job {spec!r}: {module_name} has no callable {func_name!r}")
    return as_job(call_job(spec, func), name=func_name)


def _is_path(module_name):
    return module_name.endswith(".py") or "/" in module_name or os.sep in module_name


def _import_job_module(spec, module_name):
    if _is_path(module_name):
        return _import_file(spec, module_name)
    cwd_on_path()
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        if getattr(exc, "name", None) and not module_name.startswith(exc.name):
            raise job_error(spec, "importing it", exc) from None  # the job's module imports something missing
        raise ConfigError(f"--job {spec!r}: cannot import {module_name!r} ({exc}); run from the directory that "
                          "holds it, put it on PYTHONPATH, or pass path/to/file.py:function") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's module failed (or sys.exit()ed) at import
        raise job_error(spec, "importing it", exc) from None


def _import_file(spec, path):
    """Import ``path`` as the module named after the file (registered in sys.modules, so its jobs pickle)."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ConfigError(f"--job {spec!r}: no such file: {path!r} (relative paths start from "
                          f"{os.getcwd()!r})")
    folder_on_path(os.path.dirname(full))
    name = os.path.splitext(os.path.basename(full))[0]
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == full:
        return loaded
    if loaded is not None:  # another module has the name (a file called json.py): leave it alone
        name = f"{name}__amp_patch_job"
    module_spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's file failed (or sys.exit()ed) at import
        del sys.modules[name]
        raise job_error(spec, "importing it", exc) from None
    return module


def folder_on_path(folder):
    """The job file's folder first on ``sys.path``, as ``python path/to/file.py`` puts it, so that the file
    imports its neighbours (spawned variants load the file the same way)."""
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)


def cwd_on_path():
    """``--job mypkg.jobs:make_job`` finds ``./mypkg`` first, as ``python -m`` would (spawned variants inherit it)."""
    cwd = os.getcwd()
    if sys.path[:1] not in ([cwd], [""]):
        if cwd in sys.path:
            sys.path.remove(cwd)
        sys.path.insert(0, cwd)


def call_job(spec, func, *args):
    """``func(*args)``, a raise turned into a :class:`JobError` about job ``spec``."""
    try:
        return func(*args)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's code raised (sys.exit() included): one
        # line, the traceback kept for --verbose
        raise job_error(spec, f"calling {getattr(func, '__name__', 'it')}()", exc) from None


def job_error(spec, doing, exc):
    where = user_frame(exc.__traceback__)
    at = f" at {where}" if where else ""
    details = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return JobError(f"--job {spec!r} raised {type(exc).__name__}: {exc} ({doing}{at}; --verbose shows the "
                    "traceback)", details)


_NOT_USER = tuple(os.path.join(os.path.normcase(os.path.abspath(p)), "") for p in {
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), sysconfig.get_paths()["stdlib"],
    sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})


def user_frame(tb, users_only=False):
    """``file:line`` of the innermost traceback frame in the user's code (not amp_patch, the stdlib or a
    site-packages library); else, unless ``users_only``, the innermost frame; None without one."""
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith("<")]
    mine = [f for f in frames if not os.path.normcase(os.path.abspath(f.filename)).startswith(_NOT_USER)]
    if not mine and (users_only or not frames):
        return None
    frame = (mine or frames)[-1]
    path = os.path.abspath(frame.filename)
    shown = os.path.relpath(path) if path.startswith(os.path.join(os.getcwd(), "")) else frame.filename
    return f"{shown}:{frame.lineno}"


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
