"""``apex.parallel.optimized_sync_batchnorm``: Apex's module for the SyncBatchNorm built on its ``syncbn``
extension (``apex.parallel.SyncBatchNorm`` was this class whenever ``syncbn`` imported). amp_patch has one
SyncBatchNorm, with this class's signature (``channel_last``, ``fuse_relu``, the ``z`` input):
:class:`amp_patch.legacy.apex.parallel.sync_batchnorm.SyncBatchNorm`, the same object."""
from .sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
