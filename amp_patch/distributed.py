"""torch.distributed helpers: rank-consistent overflow decisions and rank-0 logging.

Nothing here imports or initializes a process group; every function is a cheap
no-op unless ``torch.distributed`` is available, initialized and has >1 rank.
"""
import logging

import torch

log = logging.getLogger("amp_patch")


def _world():
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def agree_overflow(found_inf, device=None):
    """True on every rank if any rank saw non-finite grads (one scalar all-reduce when distributed)."""
    dist = _world()
    if dist is None:
        return found_inf
    backend = dist.get_backend()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flag = torch.tensor([1.0 if found_inf else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def rank():
    dist = _world()
    return dist.get_rank() if dist is not None else 0


class RankZeroFilter(logging.Filter):
    """Drops amp_patch log records on ranks other than 0."""

    def filter(self, record):
        return rank() == 0


def install_rank_filter(all_ranks):
    """Add the rank-0 filter to the amp_patch logger; returns a callable that removes it."""
    if all_ranks:
        return lambda: None
    flt = RankZeroFilter()
    log.addFilter(flt)
    return lambda: log.removeFilter(flt)
