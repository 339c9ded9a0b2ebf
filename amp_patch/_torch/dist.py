"""Readings of torch.distributed: world size, rank, and the one collective amp_patch issues (the overflow flag).

Nothing here imports or initializes a process group; every function is a cheap no-op unless
``torch.distributed`` is available, initialized and has >1 rank.
"""
import sys
import time
import warnings

import torch

_AVAILABLE = torch.distributed.is_available()  # (a property of the build: read once)
_C10D = torch.distributed.distributed_c10d if _AVAILABLE else None
# torch's is_initialized() is ``_world.default_pg is not None`` through two properties (three frames at every
# scale_loss block): where ``_world`` is torch's own ``_World`` holding ``_default_pg``, None there is read directly;
# anything else (torch's multi-threaded test group puts a ThreadLocalWorld there; a torch without the attribute)
# goes through the public calls.
_WORLD_TYPE = getattr(_C10D, "_World", None)


def world():
    """``torch.distributed`` when a process group of more than one rank is up, else None (every scale_loss block
    asks)."""
    if not _AVAILABLE:
        return None
    state = _C10D._world
    if type(state) is _WORLD_TYPE and state.__dict__.get("_default_pg", _C10D) is None:
        return None
    dist = torch.distributed
    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _flag_device(dist):
    """Where the overflow flag lives: the current CUDA device for NCCL (it cannot reduce CPU tensors), else CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_overflow(found_inf, device=None):
    """True on every rank if any rank saw non-finite grads (one scalar all-reduce when distributed)."""
    dist = world()
    if dist is None:
        return found_inf
    flag = torch.tensor([1.0 if found_inf else 0.0], device=device if device is not None else _flag_device(dist))
    _all_reduce_and_let_go(dist, flag, dist.ReduceOp.MAX)
    return bool(flag.item())


def _all_reduce_and_let_go(dist, tensor, op, limit_s=0.2):
    """A blocking all-reduce that, under gloo, also yields the GIL until the worker thread dropped ``tensor``.

    The collective returns as soon as its work completes; gloo's worker drops the work's tensors a moment later,
    and while a C++ reference exists torch keeps one on the tensor's Python object, so that drop takes the GIL.
    After a script's last step the worker could then need the GIL during interpreter shutdown (the process
    aborts: "terminate called without an active exception") or while the main thread holds it in a process
    group's destructor (the process hangs). The extra Python reference shows in sys.getrefcount.
    """
    refs = sys.getrefcount(tensor)
    dist.all_reduce(tensor, op=op)
    if dist.get_backend() != "gloo":
        return
    deadline = time.monotonic() + limit_s
    while sys.getrefcount(tensor) > refs:
        if time.monotonic() > deadline:
            warnings.warn(f"amp_patch: gloo kept a reference to the overflow flag {limit_s} s after the all-reduce "
                          "returned (a debug recorder holding tensors?); every step waits this long for it "
                          "(shown once)", RuntimeWarning, stacklevel=2)
            return
        time.sleep(0)  # releases the GIL


def world_size():
    dist = world()
    return dist.get_world_size() if dist is not None else 1


def rank():
    dist = world()
    return dist.get_rank() if dist is not None else 0
