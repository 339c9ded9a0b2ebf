"""amp_patch._torch.dist.world(): the process-group reading every scale_loss block makes agrees with torch's public
functions before, during and after a process group (its cheap reading of torch's default group included)."""
import os
import subprocess
import sys

import torch

from amp_patch._torch import dist

_SCRIPT = """
import os, torch, torch.distributed as tdist
from amp_patch._torch import dist
assert dist.world() is None and not tdist.is_initialized()
tdist.init_process_group("gloo", init_method="file://" + os.path.join(os.getcwd(), "store"), rank=0, world_size=1)
assert dist.world() is None  # one rank: nothing to agree with
real = tdist.get_world_size
tdist.get_world_size = lambda *a, **k: 2  # (what a two-rank group answers; the reading must reach this call)
assert dist.world() is tdist, "an initialized group of two ranks was read as no group"
tdist.get_world_size = real
tdist.destroy_process_group()
assert dist.world() is None and not tdist.is_initialized()
print("ok")
"""


def test_world_follows_a_process_group_from_init_to_destroy(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


_THREADED = """
import torch, torch.distributed as tdist
from torch.testing._internal.distributed import multi_threaded_pg
from amp_patch._torch import dist
multi_threaded_pg._install_threaded_pg()  # (torch's MultiThreadedTestCase: c10d's world becomes thread-local)
try:
    assert dist.world() is None and not tdist.is_initialized()
finally:
    multi_threaded_pg._uninstall_threaded_pg()
print("ok")
"""


def test_world_reads_torchs_thread_local_world_through_the_public_calls(tmp_path):
    """torch's multi-threaded test process group replaces c10d's world with one that keeps no ``_default_pg``:
    every scale_loss block then asks the public functions (it raised AttributeError at each block)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _THREADED], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_this_torch_is_read_through_its_default_group_attribute():
    """The cheap reading is in use on the supported torch versions (if torch renames the attribute, world() falls
    back to the public calls; this says so rather than silently costing every block three frames again)."""
    if torch.distributed.is_available():
        state = torch.distributed.distributed_c10d._world
        assert type(state) is dist._WORLD_TYPE and "_default_pg" in vars(state)
