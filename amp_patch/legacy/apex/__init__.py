"""amp_patch's implementations of the Apex modules besides ``apex.amp``, laid out as Apex's package was.

``amp_patch.legacy.apex.X`` is what the ``apex`` import alias serves as ``apex.X``: ``parallel``,
``optimizers``, ``normalization``, ``fp16_utils`` and ``multi_tensor_apply`` (the top-level ``amp_C`` and
``apex_C`` extensions are :mod:`amp_patch.legacy.amp_C` and :mod:`amp_patch.legacy.apex_C`). Each works
without the alias too (``from amp_patch.legacy.apex.optimizers import FusedAdam``). This package imports
none of them: importing it costs nothing. See docs/migration.md for what is provided and what differs.
``DeprecatedFeatureWarning`` is Apex's top-level warning class (``apex.DeprecatedFeatureWarning``) and
``deprecated_warning(msg)`` Apex's helper that issues it (on rank 0 only). amp_patch's own Apex modules never call
it: Apex's messages announced the removal of ``apex.amp``, ``apex.parallel`` and ``apex.fp16_utils`` "by the end
of February 2023" in favour of PyTorch AMP, which is what they run on here (docs/migration.md).
"""
import warnings

__all__ = ["DeprecatedFeatureWarning", "deprecated_warning"]


class DeprecatedFeatureWarning(FutureWarning):
    """Apex's warning for its deprecated features (scripts filter or raise it by this class)."""


def deprecated_warning(msg):
    """Issue ``msg`` as a :class:`DeprecatedFeatureWarning`, on rank 0 only when torch.distributed is initialized
    (Apex's helper, for code that calls it)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(msg, DeprecatedFeatureWarning, stacklevel=2)
