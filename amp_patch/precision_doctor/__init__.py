"""Public name of the precision doctor (its code: :mod:`amp_patch.tools.doctor`)."""
from ..tools.doctor import *  # noqa: F403
from ..tools.doctor import __all__  # noqa: F401
