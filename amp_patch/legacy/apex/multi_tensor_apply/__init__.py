"""``apex.multi_tensor_apply``: ``multi_tensor_applier``, a :class:`.multi_tensor_apply.MultiTensorApply` with
Apex's chunk size, calling ``op(2048 * 32, noop_flag_buffer, tensor_lists, *args)``."""
from .multi_tensor_apply import MultiTensorApply

__all__ = ["MultiTensorApply", "multi_tensor_applier"]

multi_tensor_applier = MultiTensorApply(2048 * 32)
