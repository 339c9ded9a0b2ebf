"""What one session keeps about data parallelism (DDP ``no_sync`` regions, FSDP2 groups): its ``parallel`` part.

Written by :mod:`.ddp` (the ``no_sync`` count, FSDP2's held accumulation) and by ``initialize`` (the groups, the
models to watch), read by ``scale_loss`` (:mod:`amp_patch.session.scale_loss`). Its undo steps (the DDP patches) are
registered by :mod:`.ddp` in the session's one ordered undo list; the fields themselves need no undo.
"""


class ParallelState:
    """DDP and FSDP2 fields of one session."""

    def __init__(self):
        self.no_sync_depth = 0  # open DistributedDataParallel.no_sync() regions (O2: unscale deferred inside)
        self.masters_checked = False  # the one-time DDP master-weight check of scale_loss
        self.unsharded_models = []  # not FSDP2-sharded at initialize: a later fully_shard is refused
        self.fsdp_groups = []  # FSDP2 param groups of the models (set_requires_gradient_sync(False) delays unscale)
        self.fsdp_held = None  # (scaler, loss id) of the grads FSDP2 accumulates unreduced (no gradient sync)
