"""amp_patch's implementations of the Apex modules besides ``apex.amp``, laid out as Apex's package was.

``amp_patch.legacy.apex.X`` is what the ``apex`` import alias serves as ``apex.X``: ``parallel``,
``optimizers``, ``normalization``, ``fp16_utils`` and ``multi_tensor_apply`` (the top-level ``amp_C`` and
``apex_C`` extensions are :mod:`amp_patch.legacy.amp_C` and :mod:`amp_patch.legacy.apex_C`). Each works
without the alias too (``from amp_patch.legacy.apex.optimizers import FusedAdam``). This package imports
none of them: importing it costs nothing. See docs/migration.md for what is provided and what differs.
``DeprecatedFeatureWarning`` is Apex's top-level warning class (``apex.DeprecatedFeatureWarning``).
"""

__all__ = ["DeprecatedFeatureWarning"]


class DeprecatedFeatureWarning(FutureWarning):
    """Apex's warning for its deprecated features (scripts filter or raise it by this class)."""
