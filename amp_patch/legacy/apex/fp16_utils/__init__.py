"""``apex.fp16_utils``: Apex's manual mixed-precision helpers and ``FP16_Optimizer`` (on amp_patch's master
weights and loss scaler). ``from apex.fp16_utils import *`` gives the names below, as in Apex."""
from .fp16_optimizer import FP16_Optimizer
from .fp16util import (
                       BN_convert_float,
                       FP16Model,
                       clip_grad_norm,
                       convert_module,
                       convert_network,
                       master_params_to_model_params,
                       model_grads_to_master_grads,
                       network_to_half,
                       prep_param_lists,
                       to_python_float,
                       tofp16,
)
from .loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["BN_convert_float", "network_to_half", "prep_param_lists", "model_grads_to_master_grads",
           "master_params_to_model_params", "tofp16", "to_python_float", "clip_grad_norm", "convert_module",
           "convert_network", "FP16Model", "FP16_Optimizer", "LossScaler", "DynamicLossScaler"]
