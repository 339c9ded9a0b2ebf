"""Half models (O2, O3) and the float masks ``nn.MultiheadAttention`` gets from code inside the forward.

A mask made in fp32 inside a forward (``nn.Transformer.generate_square_subsequent_mask(T)``, a ``-inf`` padding
mask) meets the half query in one ``baddbmm`` on the path that returns attention weights (``need_weights=True``,
the default), and torch refuses the mix (as for any half model: ``model.bfloat16()``, FSDP2's ``param_dtype``).
Native ``torch.autocast`` casts the mask to the half dtype there; :class:`MasksLikeQuery` does the same, on that
path only: the other one (``scaled_dot_product_attention``) takes the fp32 mask as it is and is left alone.
"""
import torch

from .._torch.hooks import FAST_PATH_TYPES, SessionHook
from ..weights.layouts import kept_fp32_ids

_MASKS = ((3, "key_padding_mask"), (5, "attn_mask"))  # positions in MultiheadAttention.forward's signature
_NEED_WEIGHTS = (4, "need_weights")


class MasksLikeQuery(SessionHook):
    """Forward pre-hook (with kwargs) of a ``MultiheadAttention``: float masks to the query's dtype where the
    attention weights are computed."""

    def __call__(self, module, args, kwargs):
        query = args[0] if args else kwargs.get("query")
        dtype = getattr(query, "dtype", None)
        if dtype is None or not dtype.is_floating_point or not _argument(args, kwargs, *_NEED_WEIGHTS, True):
            return None
        args, changed = list(args), False
        for position, name in _MASKS:
            mask = _argument(args, kwargs, position, name, None)
            if isinstance(mask, torch.Tensor) and mask.is_floating_point() and mask.dtype != dtype:
                if position < len(args):
                    args[position] = mask.to(dtype)
                else:
                    kwargs[name] = mask.to(dtype)
                changed = True
        return (tuple(args), kwargs) if changed else None


def _argument(args, kwargs, position, name, default):
    return args[position] if position < len(args) else kwargs.get(name, default)


def attention_modules(model, keep_types):
    """The ``MultiheadAttention`` modules of ``model`` that run in half: not kept fp32, not inside a fast-path
    layer (it calls them with ``need_weights=False``, and a hook inside would cost it nothing but time)."""
    inside = {id(m) for layer in model.modules() if isinstance(layer, FAST_PATH_TYPES) for m in layer.modules()}
    kept = kept_fp32_ids(model, keep_types)
    return [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)
            and id(m) not in inside and id(m) not in kept]
