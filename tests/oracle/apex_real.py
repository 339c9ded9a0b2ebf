"""Real Apex's amp Python code (NVIDIA/apex at e13873de) on CPU, for the differential against amp_patch's alias.

Apex is located by ``AMP_PATCH_APEX_SRC`` (a checkout's root, the folder holding ``apex/amp``); the tests skip
without it. Nothing of Apex is imported into the test process: :func:`run_under_real_apex` runs the programs in
a child process that loads ``apex.amp`` from that checkout with the few CUDA-only spellings made CPU ones (a
source substitution in the loader, listed in :data:`CPU_PORT`): ``torch.cuda.IntTensor`` flag buffers become CPU
tensors, the "is this a CUDA param" checks accept CPU params, and the ``apex`` package's ``__init__`` (which
imports the CUDA extensions) is replaced by a bare package. ``amp_C`` is absent, so Apex runs its own Python
fallbacks (``scale_check_overflow_python``, ``axpby_check_overflow_python``), as it did without ``--cuda_ext``.

Apex's O1 casts only CUDA tensors (``utils.maybe_half``: ``if not x.is_cuda: return x``), so on CPU its O1 is
fp32: the differential runs O0 (with a dynamic or static scale), O2 and O3, where the loss-scaler protocol, the
masters and the casts of the model are Apex's own code.
"""
import os
import pathlib
import subprocess
import sys

ENV = "AMP_PATCH_APEX_SRC"

CPU_PORT = (
    ("torch.cuda.IntTensor(", "torch.IntTensor("),
    ("torch.cuda.FloatTensor(", "torch.FloatTensor("),
    ("'torch.cuda.HalfTensor'", "'torch.HalfTensor'"),
    ("'torch.cuda.FloatTensor'", "'torch.FloatTensor'"),
    ("elif not param.is_cuda:", "elif False:"),
    ("elif not buf.is_cuda:", "elif False:"),
    ("if not t.is_cuda:", "if False:"),
)

_CHILD = r'''
import importlib.abc, importlib.util, pathlib, sys, types, warnings
SRC = pathlib.Path(sys.argv[1])
PORT = {port!r}


class _Loader(importlib.abc.SourceLoader):
    def __init__(self, path):
        self.path = path

    def get_filename(self, fullname):
        return str(self.path)

    def get_data(self, path):
        text = pathlib.Path(path).read_text()
        for old, new in PORT:
            text = text.replace(old, new)
        return text.encode()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if not name.startswith("apex."):
            return None
        base = SRC.joinpath(*name.split("."))
        init = base / "__init__.py"
        if init.exists():
            return importlib.util.spec_from_file_location(name, init, loader=_Loader(init),
                                                          submodule_search_locations=[str(base)])
        if base.with_suffix(".py").exists():
            return importlib.util.spec_from_file_location(name, base.with_suffix(".py"),
                                                          loader=_Loader(base.with_suffix(".py")))
        return None


apex = types.ModuleType("apex")
apex.__path__ = [str(SRC / "apex")]
apex.deprecated_warning = lambda msg: None
sys.modules["apex"] = apex
sys.meta_path.insert(0, _Finder())
warnings.simplefilter("ignore")
import torch
from apex import amp
import apex_programs
results = apex_programs.run_all(amp, sys.argv[2], int(sys.argv[3]))
torch.save(results, sys.argv[4])
'''


def source():
    """The Apex checkout named by ``AMP_PATCH_APEX_SRC``, or None."""
    root = os.environ.get(ENV)
    if not root or not (pathlib.Path(root) / "apex" / "amp" / "scaler.py").exists():
        return None
    return pathlib.Path(root)


def run_under_real_apex(profile, count, out, timeout=900):
    """Run ``count`` programs of ``profile`` under real Apex in a child process; the results go to ``out``."""
    here = pathlib.Path(__file__).parent
    code = _CHILD.format(port=CPU_PORT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code, str(source()), profile, str(count), str(out)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the real-Apex child failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done.stdout
