"""Helpers shared by tests (imported as a plain module: pytest puts tests/ on sys.path)."""
import functools
import os
import signal
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

_MISSING = object()
TESTS = Path(__file__).resolve().parent  # tests/: the support modules and scripts live here
REPO = TESTS.parent
LAYERS = ("unit", "behaviour", "integration", "oracle")  # tests/ folders; each test file's own is on sys.path


def leaks_of(snapshot):
    """Names whose value in a snapshotted namespace changed (new submodules excepted)."""
    leaks = []
    for ns, old in snapshot.values():
        now = dict(vars(ns))
        for key in set(old) | set(now):
            if now.get(key, _MISSING) is old.get(key, _MISSING) or key == "__slotnames__":
                continue  # (__slotnames__ is copyreg's pickling cache, filled by the first torch.save)
            if key not in old and isinstance(now[key], types.ModuleType):
                continue
            leaks.append(f"{getattr(ns, '__name__', ns)}.{key}")
    return sorted(leaks)


class CountCasts(TorchDispatchMode):
    """Counts aten._to_copy calls (every dtype cast), with the target dtypes seen."""

    def __init__(self):
        super().__init__()
        self.casts = 0
        self.dtypes = []
        self.ops = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            self.casts += 1
            self.dtypes.append(kwargs.get("dtype"))
        out = func(*args, **kwargs)
        self.ops.append((func, getattr(out, "dtype", None)))
        return out


def _descendants(pid):
    """Every live process below pid (torchrun starts its workers in sessions of their own, so a process group
    does not reach them; /proc's parent links do). Read before anything is killed: orphans move to init."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


# The probe's median time (50k iterations of a Python loop) on an idle core of this project's 2-core EPYC.
_PROBE_IDLE_S = 0.0025
TIME_SCALE_ENV = "AMP_PATCH_TEST_TIME_SCALE"


@functools.lru_cache(maxsize=None)
def machine_slowdown():
    """How much slower than idle this machine runs Python now (>= 1), measured once per test process: the median
    of five short probes over the idle figure. A loaded 2-core box (load 10-18) measures 5-10."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        total = 0
        for i in range(50_000):
            total += i
        times.append(time.perf_counter() - start)
    return max(1.0, statistics.median(times) / _PROBE_IDLE_S)


def time_limit(seconds):
    """A limit for work that takes at most about ``seconds`` on an idle machine: three times that, times the
    measured :func:`machine_slowdown` (``AMP_PATCH_TEST_TIME_SCALE`` replaces the whole factor). A limit only
    ends a hung test, so a generous one costs nothing when the test passes; no pass depends on the speed."""
    factor = os.environ.get(TIME_SCALE_ENV)
    return seconds * (float(factor) if factor else 3.0 * machine_slowdown())


def run_killing_group(cmd, cwd, env=None, timeout=120, scale=True):
    """subprocess.run that, on timeout, kills the launcher and everything it started (torchrun's workers live in
    sessions of their own and hold the output pipes), then fails the test; stdout and stderr are captured
    separately. ``timeout`` is an idle machine's figure, scaled by :func:`time_limit` unless ``scale`` is False."""
    timeout = round(time_limit(timeout)) if scale else timeout
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(cwd), env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "(output pipes still held open)", ""
        pytest.fail(f"{' '.join(map(str, cmd))} timed out after {timeout}s (limit scaled to this machine's measured "
                    f"speed; set {TIME_SCALE_ENV} to change it):\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_python(code, tmp_path, timeout=180):
    """Run ``code`` in a fresh interpreter (tests/, its layer folders and the checkout on sys.path, cwd tmp_path);
    return its stdout lines, failing the test with its stderr when it exits non-zero."""
    layers = [str(TESTS / layer) for layer in LAYERS]
    path = [str(TESTS), *layers, str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    proc = run_killing_group([sys.executable, "-c", code], tmp_path, env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


class SmallNet(torch.nn.Module):
    """linear -> gelu -> layer_norm + residual -> linear, and a softmax over a matmul: half, float and promote ops."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.fc2 = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        h = self.norm(h) + x
        return self.fc2(h), torch.nn.functional.softmax(h @ h.t(), dim=-1)


def split_params(text):
    """A signature's parameter list split at its top-level commas (docs/api.md checks use it)."""
    params, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            params.append(current.strip())
            current = ""
        else:
            current += ch
    return [p for p in params + [current.strip()] if p and p != "*"]


def compute_dtypes(model, *args, **kwargs):
    """{param name: dtype} of the weights ``model``'s forward runs on (under O2: its half compute copies, while
    the registered params stay fp32), every name of a tied param included."""
    seen = {}

    def record(module, call_args):
        seen.update({n: p.dtype for n, p in module.named_parameters(remove_duplicate=False)})

    handle = model.register_forward_pre_hook(record)
    try:
        model(*args, **kwargs)
    finally:
        handle.remove()
    return seen


class Interruptible(torch.nn.Module):
    """A pass-through layer that raises ``KeyboardInterrupt`` (Ctrl-C: a ``BaseException``, after which torch runs no
    always-called hook) while ``armed``."""

    armed = False

    def forward(self, x):
        if self.armed:
            raise KeyboardInterrupt
        return x


def forward_on_instance(model):
    """Give ``model`` its class's forward as an attribute of the instance (as accelerate's wrappers set it), before
    ``initialize``: amp_patch's guard on the class's forward then cannot see a Ctrl-C there, and the frame checks
    that find a cut-off call later are what ends it."""
    model.forward = type(model).forward.__get__(model)
    return model
