"""``apex.amp.lists.tensor_overrides``: Apex's O1 lists for ``torch.Tensor`` (edit before initialize).

As in Apex, each list also holds the names of the matching ``torch_overrides`` list that are Tensor methods.
"""
import torch

from . import torch_overrides
from ._names import OpNameList

MODULE = torch.Tensor
_Q = "apex.amp.lists.tensor_overrides."


def _with_torch_names(kind, own):
    names = [n for n in own if hasattr(MODULE, n)]
    names += [n for n in getattr(torch_overrides, kind) if hasattr(MODULE, n)]
    return OpNameList(_Q + kind, names)


FP16_FUNCS = _with_torch_names("FP16_FUNCS", ["__matmul__"])
FP32_FUNCS = _with_torch_names("FP32_FUNCS", ["__ipow__", "__pow__", "__rpow__", "cpu"])
CASTS = _with_torch_names("CASTS", [
    "__add__", "__div__", "__eq__", "__ge__", "__gt__", "__iadd__", "__idiv__", "__imul__", "__isub__",
    "__itruediv__", "__le__", "__lt__", "__mul__", "__ne__", "__radd__", "__rdiv__", "__rmul__", "__rsub__",
    "__rtruediv__", "__sub__", "__truediv__",
])
SEQUENCE_CASTS = _with_torch_names("SEQUENCE_CASTS", [])
