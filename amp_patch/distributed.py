"""``amp_patch.distributed``: the public DDP helpers, each from its home (:mod:`amp_patch._torch.dist`,
:mod:`amp_patch.parallel.ddp`, :mod:`amp_patch.session.master_sync`)."""
from ._torch.dist import agree_overflow, rank, world_size
from .parallel.ddp import check_unscale_inside_no_sync
from .session.master_sync import broadcast_master_params, masters_out_of_sync

__all__ = ["agree_overflow", "broadcast_master_params", "masters_out_of_sync", "check_unscale_inside_no_sync",
           "world_size", "rank"]
