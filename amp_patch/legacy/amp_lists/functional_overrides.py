"""``apex.amp.lists.functional_overrides``: Apex's O1 lists for ``torch.nn.functional`` (edit before initialize)."""
import torch.nn.functional

from ._names import OpNameList

MODULE = torch.nn.functional
_Q = "apex.amp.lists.functional_overrides."

FP16_FUNCS = OpNameList(_Q + "FP16_FUNCS", [
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "linear",
])

FP32_FUNCS = OpNameList(_Q + "FP32_FUNCS", [
    "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "gelu", "layer_norm",
    "group_norm", "local_response_norm", "normalize", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss", "kl_div", "l1_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss", "nll_loss",
    "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss", "triplet_margin_loss", "ctc_loss",
])

# (name, message) pairs, as in Apex; amp_patch's banned message is the shipped op list's.
BANNED_FUNCS = OpNameList(_Q + "BANNED_FUNCS", [
    ("binary_cross_entropy", "use torch.nn.BCEWithLogitsLoss (Sigmoid + BCELoss in one), or "
                             "amp.register_float_function(torch, 'sigmoid'), or allow_banned=True"),
])
