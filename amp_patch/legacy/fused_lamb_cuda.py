"""Stand-in for Apex's ``fused_lamb_cuda`` extension (``apex.contrib``'s LAMB kernel): ``lamb`` has the signature
and math of ``amp_C.multi_tensor_lamb`` (:mod:`amp_patch.legacy.amp_C`), on torch math."""
from .amp_C import multi_tensor_lamb as lamb

__all__ = ["lamb"]
