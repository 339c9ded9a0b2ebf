"""``apex.amp.lists.torch_overrides``: Apex's O1 lists for ``torch`` (edit before initialize)."""
import torch

from ._names import OpNameList

MODULE = torch
_Q = "apex.amp.lists.torch_overrides."

# (addbmm/baddbmm/bmm: half, as Apex had them on CUDA >= 9.1)
FP16_FUNCS = OpNameList(_Q + "FP16_FUNCS", [
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "prelu",
    "addmm", "addmv", "addr", "matmul", "mm", "mv", "addbmm", "baddbmm", "bmm",
])

FP32_FUNCS = OpNameList(_Q + "FP32_FUNCS", [
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal", "rsqrt", "sinh", "tan",
    "pow", "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var", "renorm",
])

CASTS = OpNameList(_Q + "CASTS", [
    "addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "add", "div", "mul", "eq", "equal", "ge", "gt", "le",
    "lt", "ne",
])

SEQUENCE_CASTS = OpNameList(_Q + "SEQUENCE_CASTS", ["cat", "stack"])
