"""``apex.optimizers``: Apex's fused optimizers with their arguments, math and state_dict layout, written
with ``torch._foreach_*`` (any device). Use them alone or as the optimizer passed to
``amp_patch.initialize`` at any opt level (under O2 they update the fp32 master weights).
``FP16_Optimizer`` is :class:`amp_patch.legacy.apex.fp16_utils.FP16_Optimizer` (old scripts imported it
from here)."""
from .fused_adagrad import FusedAdagrad
from .fused_adam import FusedAdam
from .fused_lamb import FusedLAMB, FusedMixedPrecisionLamb
from .fused_novograd import FusedNovoGrad
from .fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedSGD", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad", "FusedAdagrad",
           "FP16_Optimizer"]


def __getattr__(name):
    if name == "FP16_Optimizer":
        from ..fp16_utils import FP16_Optimizer
        return FP16_Optimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
