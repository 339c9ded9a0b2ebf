"""Stand-in for Apex's ``apex_C`` extension: ``flatten`` / ``unflatten`` on torch's own flatten utilities.

``flatten(tensors)`` returns one contiguous 1-D tensor holding them all (they must share a dtype);
``unflatten(flat, tensors)`` returns views of ``flat`` shaped like ``tensors``, as Apex's C++ helpers did.
"""
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["flatten", "unflatten"]


def flatten(tensors):
    """One contiguous 1-D tensor with the elements of ``tensors`` in order."""
    return _flatten_dense_tensors(tensors)


def unflatten(flat, tensors):
    """Views of ``flat`` with the shapes of ``tensors`` (the inverse of :func:`flatten`)."""
    return _unflatten_dense_tensors(flat, tensors)
