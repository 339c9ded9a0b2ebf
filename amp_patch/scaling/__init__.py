"""Loss scaling: the scalers, gradient unscaling and per-optimizer state (``scale_loss``, the protocol that drives
them, lives in :mod:`amp_patch.session.scale_loss`).

* :mod:`.scaler`: :class:`~amp_patch.scaling.scaler.LossScaler` (one per loss id: dynamic/static scale,
  hysteresis, bounds), ``parse_loss_scale`` and the session-wide ``state_dict_for`` / ``load_state_dict_into``.
* :mod:`.unscale`: ``unscale_`` / ``unscale_into`` (multiply by 1/scale, detect inf/NaN, one host sync per call).
* :mod:`.optimizer_state`: ``OptimizerState``, each optimizer's step hooks, fp32 masters and skipped steps.

Importing this package defines functions only (no YAML read, no patching).
"""
