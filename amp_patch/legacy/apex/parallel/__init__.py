"""``apex.parallel``: DistributedDataParallel (Apex's arguments on torch's DDP), Reducer, SyncBatchNorm,
convert_syncbn_model and create_syncbn_process_group. See :mod:`.distributed` and :mod:`.sync_batchnorm`."""
from .distributed import DistributedDataParallel, Reducer
from .sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

__all__ = ["DistributedDataParallel", "Reducer", "SyncBatchNorm", "convert_syncbn_model",
           "create_syncbn_process_group"]
