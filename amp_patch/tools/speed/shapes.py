"""Matrix sizes that keep half-precision matmuls off their fast path: Linear and conv sizes not multiples of 8.

float16/bfloat16 matmuls and convolutions run on tensor cores (and on the CPU's AMX/AVX-512 tiles) when the sizes
they multiply are multiples of 8; other sizes are padded inside the kernel or take a slower one. The check reads the
layers' own sizes (a Linear's ``in_features``/``out_features``, a conv's channels); a conv's input channels of 4 or
fewer (an image's RGB) are not flagged, as nothing can pad them usefully.
"""
from torch import nn

MULTIPLE = 8
_SIZES = {nn.Linear: ("in_features", "out_features"),
          nn.modules.conv._ConvNd: ("in_channels", "out_channels")}


def padded(size, multiple=MULTIPLE):
    return -(-size // multiple) * multiple


def sizes(module):
    """``[(attribute, size)]`` of a Linear or conv module, else []."""
    for kind, names in _SIZES.items():
        if isinstance(module, kind):
            return [(name, getattr(module, name)) for name in names]
    return []


def misaligned(module):
    """``[(attribute, size, padded size)]`` for the sizes of ``module`` that are not multiples of 8."""
    conv = isinstance(module, nn.modules.conv._ConvNd)
    return [(name, size, padded(size)) for name, size in sizes(module)
            if size % MULTIPLE and not (conv and name == "in_channels" and size <= 4)]
