"""Loss scaling: the scalers, gradient unscaling, the ``scale_loss`` protocol and per-optimizer state.

* :mod:`.scaler`: :class:`~amp_patch.scaling.scaler.LossScaler` (one per loss id: dynamic/static scale,
  hysteresis, bounds), ``parse_loss_scale`` and the session-wide ``state_dict_for`` / ``load_state_dict_into``.
* :mod:`.unscale`: ``unscale_`` / ``unscale_into`` (multiply by 1/scale, detect inf/NaN, one host sync per call).
* :mod:`.protocol`: ``scale_loss`` (re-exported here and as ``amp_patch.scale_loss``), the per-iteration protocol
  between backward, the scalers and the optimizers.
* :mod:`.optimizer_state`: ``OptimizerState``, each optimizer's step hooks, fp32 masters and skipped steps.

Importing this package defines functions only (no YAML read, no patching).
"""
from .protocol import scale_loss  # noqa: F401 - the package's public name (amp_patch.scaling.scale_loss)
