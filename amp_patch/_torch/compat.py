"""The torch versions amp_patch supports, and the one place it looks up what it reads from torch's internals.

amp_patch is tested on torch 2.11 to 2.15 (docs/api.md, "Tested versions"). Private torch APIs it relies on
(dynamo's trace rules, ...) move between releases; :func:`internal` finds one by its dotted path and, when this
torch lacks it, raises :class:`~amp_patch.errors.TorchVersionError` naming the torch version, what is missing
and what for, instead of an ``AttributeError`` from deep inside amp_patch.
"""
import importlib
import sys

import torch

from ..errors import TorchVersionError

TESTED = ("2.11", "2.15")  # the first and the last minor release the test suite runs on

# Whether dynamo is tracing the caller (torch.compile, strict torch.export): dynamo folds this to True. In eager it is
# one Python frame returning False, where ``torch.compiler.is_compiling`` is two (it asks ``torch.jit.is_scripting``)
# and also reads True inside torch's compile and export sessions outside dynamo's tracing (AOTAutograd, non-strict
# export running the forward in Python: not a tracer amp_patch supports). Hooks that run on every module call ask it:
# measured, its two frames a call were ~20 of O2's per-step frames.
tracing = torch.compiler.is_dynamo_compiling
REQUIREMENT = "torch>=2.11,<2.16"  # setup.cfg's install_requires says the same


def release(version=None):
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)`` (this torch's when ``version`` is None)."""
    return tuple(torch.torch_version.Version(str(version or torch.__version__)).release)


def tested(version=None):
    """True when ``version`` (this torch's by default) is a release of the tested range."""
    running = release(version)[:2]
    return release(TESTED[0])[:2] <= running <= release(TESTED[1])[:2]


def internal(path, purpose):
    """The object at the dotted ``path`` (``"torch._dynamo.trace_rules.get_torch_obj_rule_map"``), importing its
    module when it is a torch submodule not yet imported; :class:`TorchVersionError` when this torch lacks it."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        name = ".".join(parts[:i])
        try:
            obj = sys.modules.get(name) or importlib.import_module(name)
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                raise _missing(f"{name}.{attr}", purpose)
            obj, name = getattr(obj, attr), f"{name}.{attr}"
        return obj
    raise _missing(path, purpose)


def _missing(what, purpose):
    return TorchVersionError(f"amp_patch needs {what} ({purpose}), which torch {torch.__version__} does not have; "
                             f"amp_patch is tested on torch {TESTED[0]} to {TESTED[1]}: install one "
                             f"(pip install '{REQUIREMENT}')")
