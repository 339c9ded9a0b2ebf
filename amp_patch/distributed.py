"""``amp_patch.distributed``: the public name of :mod:`amp_patch.parallel.ddp` (DDP helpers)."""
from .parallel.ddp import *  # noqa: F403
from .parallel.ddp import __all__  # noqa: F401
