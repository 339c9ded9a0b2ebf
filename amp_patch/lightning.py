"""``amp_patch.lightning``: the public name of :mod:`amp_patch.integrations.lightning` (plugins)."""
from .integrations.lightning import *  # noqa: F403
from .integrations.lightning import __all__  # noqa: F401
