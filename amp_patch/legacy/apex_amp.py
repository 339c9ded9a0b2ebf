"""The ``apex.amp`` surface, implemented by amp_patch.

``from amp_patch.legacy import amp`` gives this module; under the alias
(``amp-patch run`` or :func:`amp_patch.legacy.install_apex_alias`) ``apex.amp``
exposes the same names. Apex's new API (``initialize``, ``scale_loss``,
``master_params``, ``state_dict``/``load_state_dict``, registrations, decorators,
``disable_casts``) is amp_patch's own; the old handle API (``amp.init()``) lives
in :mod:`amp_patch.legacy.handle`; ``_amp_state`` is a live view of the session
(:mod:`amp_patch.legacy.amp_state`). Other Apex names raise an
:class:`~amp_patch.legacy.unsupported.ApexAttributeError` naming the alternative.
"""
import functools
import logging

from ..errors import UnexpectedKeysError
from ..session import state as _state
from ..session.accessors import load_state_dict as _load_state_dict
from ..session.accessors import state_dict
from ..session.api import deinitialize
from ..session.api import initialize as _initialize
from ..session.scale_loss import scale_loss
from ..session.user_functions import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
)
from . import amp_lists as lists  # noqa: F401 - apex.amp.lists (not star-imported, as in Apex)
from . import messages, stacking
from .amp_state import AMP_STATE as _amp_state  # noqa: F401 - apex.amp._amp_state
from .amp_state import master_params
from .handle import init
from .registrations import register_float_function, register_half_function, register_promote_function
from .unsupported import attribute_error

__all__ = [
    "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict", "register_half_function",
    "register_float_function", "register_promote_function", "half_function", "float_function", "promote_function",
    "disable_casts", "init", "deinitialize",
]
_EXTRA = ["_amp_state", "lists"]  # provided by ``apex.amp`` too, but not star-imported (as in Apex)

log = logging.getLogger("amp_patch")


@functools.wraps(_initialize)
def initialize(*args, **kwargs):
    """Apex's ``amp.initialize``: amp_patch's, except that a second call adds to the open session.

    As in Apex, the models and optimizers of earlier calls stay initialized and keep training, and the loss
    scalers are the new call's. A call with other options (another opt level) closes the open session first,
    with a warning. See :mod:`amp_patch.legacy.stacking`; ``amp_patch.initialize`` itself still refuses a
    second call. Apex's printed lines (the selected opt level and options, the overflow-skipped steps) are
    printed as Apex printed them (:mod:`amp_patch.legacy.messages`).
    """
    call = stacking._SIGNATURE.bind(*args, **kwargs).arguments
    messages.print_initialize(call)
    result = stacking.initialize(*args, **kwargs)
    session = _state.current()
    if session is not None and session.enabled:
        messages.install(session)
    return result


def load_state_dict(state_dict):
    """Apex's ``amp.load_state_dict``: the loss scalers' entries are loaded, then keys that name no loss scaler
    raise (``UnexpectedKeysError``, a ``RuntimeError`` as Apex's), so a script that catches it keeps the loaded
    scales, as under Apex. Otherwise amp_patch's (docs/migration.md)."""
    unexpected = [key for key in state_dict if "loss_scaler" not in str(key)] if isinstance(state_dict, dict) else []
    if not unexpected:
        return _load_state_dict(state_dict)
    _load_state_dict({key: value for key, value in state_dict.items() if key not in unexpected})
    raise UnexpectedKeysError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
                              f"{', '.join(repr(k) for k in unexpected)} (the loss scalers' entries were loaded; "
                              "pass amp.state_dict()'s output, whose keys are 'loss_scaler0', 'loss_scaler1', ...)")


def __getattr__(name):
    """Unknown ``apex.amp`` names: an AttributeError (and AmpPatchError) naming the feature and the alternative."""
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(f"module 'apex.amp' has no attribute {name!r}")
    raise attribute_error(f"amp.{name}")
