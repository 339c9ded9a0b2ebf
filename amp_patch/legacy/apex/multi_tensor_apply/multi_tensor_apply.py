"""``apex.multi_tensor_apply.multi_tensor_apply``: the applier class; ``apex.multi_tensor_apply`` exports
``multi_tensor_applier(op, noop_flag_buffer, tensor_lists, *args)``.

Apex's applier called its CUDA kernels as ``op(chunk_size, noop_flag_buffer, tensor_lists, *args)``; here
the ops are :mod:`amp_patch.legacy.amp_C`'s torch-based functions (any callable with that signature works),
so the applier is always ``available`` on every device.
"""

__all__ = ["MultiTensorApply"]


class MultiTensorApply:
    """Calls ``op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)`` and returns its result."""

    available = True
    warned = False

    def __init__(self, chunk_size):
        self.chunk_size = chunk_size

    def check_avail(self):
        """Apex raised here when its extension was missing; the torch-based ops are always there."""

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        self.check_avail()
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)

