"""Public name of the opt-level experiment (its code: :mod:`amp_patch.tools.experiment`)."""
from ..tools.experiment import *  # noqa: F403
from ..tools.experiment import __all__  # noqa: F401
