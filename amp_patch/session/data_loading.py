"""The data pipeline never casts: a DataLoader fetch runs with casting off, whatever ``num_workers`` is.

DataLoader workers are forked or spawned processes, where amp_patch's engines are closed (``casting.interop.
forked``): a transform that calls a patched op (``torch.matmul`` in a collate function, say) gets fp32 there. With
``num_workers=0`` the same fetch runs in the training thread, where casting is on; without this patch the same
code would give float16 or float32 depending on ``num_workers``. So the single-process fetch
(``_SingleProcessDataLoaderIter._next_data``: the dataset's ``__getitem__``/``__iter__``, the sampler, the
collate function, pinning) runs with casting paused in this thread, as the workers run: one semantic, fp32. Cast
inside the model's forward (or an ``amp_patch.autocast()`` region around the transform itself) instead.
"""
import functools

from torch.utils.data import dataloader as _dataloader


def install(engine, patcher):
    """Patch (through ``patcher``, whose ``restore_all`` undoes it) the single-process fetch to pause ``engine``'s
    casting."""
    target = getattr(_dataloader, "_SingleProcessDataLoaderIter", None)
    if target is None or "_next_data" not in vars(target):
        return
    casts_disabled = engine.casts_disabled

    def make(original):
        @functools.wraps(original)
        def _next_data(self):
            with casts_disabled():
                return original(self)
        return _next_data

    patcher.install(target, "_next_data", make)
