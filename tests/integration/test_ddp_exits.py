"""Exits of distributed scripts: a good run must not end in an abort or a hang.

torch's part: gloo's worker threads drop a finished collective's tensors a moment after the collective returns,
and that drop takes the GIL when the tensor has a Python object. If the interpreter is shutting down by then the
process aborts; if the main thread holds the GIL inside a process group's destructor it hangs. amp_patch's own
per-step collective (the overflow flag) therefore waits until the worker let go of its tensor, and
apex.parallel.DistributedDataParallel frees its reducer before its Python reference to the group.
"""
import os
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
from tests_support import TESTS

from amp_patch._torch import dist as amp_dist

HERE = str(TESTS)
SCRIPT = os.path.join(HERE, "_ddp_exit_script.py")


class _SlowWorkerDist:
    """Stands in for torch.distributed with a gloo worker that holds the tensor `hold_s` after returning."""
    ReduceOp = types.SimpleNamespace(MAX="max")

    def __init__(self, backend, hold_s):
        self.backend, self.hold_s = backend, hold_s

    def get_backend(self):
        return self.backend

    def all_reduce(self, tensor, op):
        held = [tensor]
        threading.Thread(target=lambda: (time.sleep(self.hold_s), held.clear()), daemon=True).start()


class _Clock:
    """Stands in for the module's ``time``: each monotonic() read advances ``step`` seconds (no real waiting)."""

    def __init__(self, step):
        self.now, self.step, self.reads = 0.0, step, 0

    def monotonic(self):
        self.reads += 1
        self.now += self.step
        return self.now

    @staticmethod
    def sleep(seconds):
        time.sleep(seconds)


def test_the_overflow_all_reduce_returns_only_after_the_gloo_worker_let_go():
    flag = torch.zeros(1)
    refs = sys.getrefcount(flag)
    # a limit no loaded machine reaches: the pass depends on the worker letting go, not on how fast it does
    amp_dist._all_reduce_and_let_go(_SlowWorkerDist("gloo", 0.05), flag, "max", limit_s=600)
    assert sys.getrefcount(flag) == refs


def test_the_wait_is_bounded_and_only_under_gloo(monkeypatch):
    """Counted on a fake clock (wall-clock bounds fail on a loaded machine)."""
    class _Keeps(_SlowWorkerDist):
        def all_reduce(self, tensor, op):
            self.held = tensor  # never let go

    clock = _Clock(0.01)
    monkeypatch.setattr(amp_dist, "time", clock)
    flag = torch.zeros(1)
    with pytest.warns(RuntimeWarning, match="kept a reference"):
        amp_dist._all_reduce_and_let_go(_Keeps("gloo", 0), flag, "max", limit_s=0.1)
    assert 0.1 < clock.now <= 0.13 and clock.reads <= 13  # gave up at the limit, not before, not much after

    clock = _Clock(0.01)
    monkeypatch.setattr(amp_dist, "time", clock)
    flag = torch.zeros(1)
    refs = sys.getrefcount(flag)
    amp_dist._all_reduce_and_let_go(_SlowWorkerDist("nccl", 0.5), flag, "max")
    assert clock.reads == 0 and sys.getrefcount(flag) == refs + 1  # NCCL's watchdog: not waited for at all


def _exit_codes(mode, tmp_path, index):
    """Both ranks' exit codes of one run of the issue's script ("hang" for a rank still alive after 120 s)."""
    store = tmp_path / f"run{index}"
    store.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, SCRIPT, mode, str(rank), str(store)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    codes = []
    for proc in procs:
        try:
            proc.communicate(timeout=120)
            codes.append(proc.returncode)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            codes.append("hang")
    return codes


@pytest.mark.stress
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_twenty_runs_of_the_two_rank_o2_script_exit_cleanly(tmp_path):
    """An earlier release measured 6 aborts in 20 runs with amp_patch (2 with torch alone). Two runs at a time, so the
    ranks compete for the 2 cores as a busy machine makes them do (the race needs a late worker).

    Opt-in (``pytest -m stress``; 40 processes, ~50 s idle and over 10 minutes under load): the mechanism it
    exercises is guarded by the deterministic tests above on every run."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda i: _exit_codes("amp_patch", tmp_path, i), range(20)))
    bad = {i: codes for i, codes in enumerate(runs) if codes != [0, 0]}
    aborts = sum(code == -6 for codes in runs for code in codes)
    assert not bad, f"{len(bad)} of 20 runs did not exit cleanly ({aborts} SIGABRT): {bad}"


def test_a_reference_gloo_never_drops_costs_the_limit_and_says_so_once():
    flag, holder = torch.zeros(1), []

    class _Keeps(_SlowWorkerDist):
        def all_reduce(self, tensor, op):
            holder.append(tensor)

    with pytest.warns(RuntimeWarning, match="kept a reference to the overflow flag"):
        amp_dist._all_reduce_and_let_go(_Keeps("gloo", 0), flag, "max", limit_s=0.05)
