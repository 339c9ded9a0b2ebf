"""``amp_patch.fsdp2``: the public name of :mod:`amp_patch.parallel.fsdp2` (FSDP2 with O2)."""
from .parallel.fsdp2 import *  # noqa: F403
from .parallel.fsdp2 import __all__  # noqa: F401
