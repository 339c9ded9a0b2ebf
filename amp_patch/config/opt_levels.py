"""Opt levels O0-O3 and the rules for overriding their properties (Apex semantics).

``resolve(opt_level, **overrides)`` returns a frozen :class:`Properties`; every
rejected combination raises ``ConfigError`` saying what was passed, why it is
not allowed, and what to do instead.
"""
import dataclasses

import torch

from ..config.dtypes import HALF_DTYPES, parse_half_dtype
from ..errors import ConfigError
from .loss_scale import parse_loss_scale as _parse_static_or_dynamic


@dataclasses.dataclass(frozen=True)
class Properties:
    """The resolved configuration of one session."""

    opt_level: str
    cast_model_type: object  # None (leave the model: also what cast_model_type=False asks for) or a dtype
    patch_torch_functions: bool
    keep_batchnorm_fp32: object  # None, True or False
    master_weights: bool
    loss_scale: object  # "dynamic" or a float
    half_dtype: torch.dtype
    cast_model_outputs: object = None
    keep_fp32_modules: tuple = ()
    master_storage: str = "fp32"  # two-copy masters: "fp32" (kept between steps) or "remainder" (bf16 weight + int16)
    master_rounding: str = "nearest"  # how fp32 masters reach the half model: "nearest" (torch) or "split"
    #: whose rules apply: "amp_patch" (its own API) or "apex" (the alias: Apex's scaler counting, float64 model
    #: inputs/outputs cast as Apex's to_type, the two-copy O2 layout, model grads kept after a scale_loss exit)
    api: str = "amp_patch"
    #: who owns the weights (docs/architecture.md "Weight layouts"): "none" (no half model weights: O0, O1;
    #: or O3's half params, which are the only weights), "one_owner" (O2: the fp32 params are the masters, the
    #: forward uses half compute copies), "two_copy" (O2: half model params plus fp32 masters beside them) or
    #: "fsdp2" (FSDP2's MixedPrecisionPolicy casts the sharded models; initialize casts nothing)
    weight_layout: str = "none"

    @property
    def dynamic(self):
        return self.loss_scale == "dynamic"

    @property
    def model_cast(self):
        """The dtype initialize casts the models' params to, or None (O1; FSDP2's policy casts sharded ones)."""
        return None if self.weight_layout == "fsdp2" else self.cast_model_type

    @property
    def two_copy(self):
        """Half model params with fp32 masters beside them (the optimizer steps the masters)."""
        return self.weight_layout == "two_copy"

    @property
    def cast_float64_io(self):
        """Model inputs/outputs in float64 are cast too (Apex's ``to_type``); amp_patch's own API leaves them."""
        return self.api == "apex"


_DEFAULTS = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None,
               master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type="half", patch_torch_functions=False, keep_batchnorm_fp32=True,
               master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type="half", patch_torch_functions=False, keep_batchnorm_fp32=False,
               master_weights=False, loss_scale=1.0),
}
OPT_LEVELS = tuple(_DEFAULTS)


def check_opt_level(opt_level):
    if opt_level in _DEFAULTS:
        return opt_level
    hint = ""
    if isinstance(opt_level, str) and opt_level != opt_level.strip() and opt_level.strip().upper() in _DEFAULTS:
        hint = f" It has whitespace around it: use {opt_level.strip().upper()!r}."
    elif isinstance(opt_level, str) and opt_level.upper().replace("0", "O", 1) in _DEFAULTS and opt_level[:1] == "0":
        hint = (f" The first character is the digit zero; opt levels start with the capital letter O "
                f"(\"{'O' + opt_level[1:]}\").")
    elif isinstance(opt_level, str) and opt_level.upper() in _DEFAULTS:
        hint = f" Opt levels are case-sensitive: use {opt_level.upper()!r}."
    raise ConfigError(f"opt_level={opt_level!r} is not an opt level; allowed: {', '.join(OPT_LEVELS)}.{hint}")


def parse_loss_scale(value):
    """``"dynamic"`` or the static scale as a float, by the loss scaler's rule (one rule for every entry point)."""
    static = _parse_static_or_dynamic(value)
    return "dynamic" if static is None else static


def _parse_bool_like(value, name):
    if value in ("True", "False"):
        return value == "True"
    if value is None or isinstance(value, bool):
        return value
    raise ConfigError(f"{name}={value!r}; allowed: True, False, None (or the strings \"True\"/\"False\")")


def _check_o1_overrides(o):
    if o.get("cast_model_type") not in (None, False, torch.float32):
        raise ConfigError(f"opt_level='O1' with cast_model_type={o['cast_model_type']}: O1 inserts casts around "
                          "torch functions and keeps the model's weights in float32. To cast the model itself, "
                          "use opt_level='O2' or 'O3'.")
    if o.get("keep_batchnorm_fp32") is not None:
        raise ConfigError("opt_level='O1' with keep_batchnorm_fp32: under O1 batchnorm already runs in the input's "
                          "dtype with float32 weights; leave keep_batchnorm_fp32=None, or use opt_level='O2'.")
    if o.get("master_weights") is not None:
        raise ConfigError("opt_level='O1' with master_weights: under O1 the model's weights stay float32, so they "
                          "are already the master weights; leave master_weights=None, or use opt_level='O2'.")


APIS = ("amp_patch", "apex")


def resolve(opt_level, *, half_dtype=None, keep_fp32_modules=(), master_rounding=None, api="amp_patch",
            fsdp2_sharded=False, half_params=False, **overrides):
    """Apply Apex's defaults for ``opt_level`` and the user's ``overrides`` (None means 'not given').

    The one place the session's policy is decided: ``api`` (whose rules: ``"amp_patch"`` or ``"apex"``) and
    ``fsdp2_sharded`` (the models are sharded by FSDP2) and ``half_params`` (they hold half params already:
    ``allow_incoming_model_not_fp32``) are facts the caller reads; the weight layout follows."""
    if api not in APIS:
        raise ValueError(f"api={api!r}; allowed: {', '.join(APIS)}")
    opt_level = check_opt_level(opt_level)
    given = {k: v for k, v in overrides.items() if v is not None}
    storage = _check_master_storage(opt_level, given.get("master_weights"))
    if storage == "remainder":
        del given["master_weights"]
    if "keep_batchnorm_fp32" in given:
        given["keep_batchnorm_fp32"] = _parse_bool_like(given["keep_batchnorm_fp32"], "keep_batchnorm_fp32")
    if opt_level == "O1":
        _check_o1_overrides(given)
    if given.get("patch_torch_functions") and opt_level != "O1":
        raise ConfigError(f"patch_torch_functions=True with opt_level={opt_level!r}: patching torch functions is "
                          "what O1 does; use opt_level='O1', or amp_patch.autocast() for a region.")
    half_dtype = _resolve_half_dtype(half_dtype, given.get("cast_model_type"))
    props = dict(_DEFAULTS[opt_level])
    if half_dtype is torch.bfloat16 and "loss_scale" not in given and props["loss_scale"] == "dynamic":
        props["loss_scale"] = 1.0  # bf16 has fp32's range: no scaling, but overflow still skips the step
    props.update({k: v for k, v in given.items() if k in props})
    if props["cast_model_type"] is False:  # Apex: False means "do not cast the model" (None: the level's default)
        props["cast_model_type"] = None
    if props["cast_model_type"] == "half":
        props["cast_model_type"] = half_dtype
    props["loss_scale"] = parse_loss_scale(props["loss_scale"])
    props["master_weights"] = bool(props["master_weights"])
    rounding = _check_master_rounding(master_rounding, storage, props, half_dtype)
    if storage == "remainder" and half_dtype is not torch.bfloat16:
        raise ConfigError(f"master_weights='remainder' with half_dtype={half_dtype}: only a bfloat16 weight is the "
                          "top 16 bits of its fp32 master (float16 has other exponent bits), so the 16-bit "
                          "remainder cannot make it exact. Pass half_dtype=torch.bfloat16, or master_weights=True "
                          "for float16 with fp32 masters")
    layout = _weight_layout(props, storage, rounding, api, fsdp2_sharded, half_params)
    return Properties(opt_level=opt_level, half_dtype=half_dtype,
                      cast_model_outputs=overrides.get("cast_model_outputs"),
                      keep_fp32_modules=_check_module_types(keep_fp32_modules), master_storage=storage,
                      master_rounding=rounding, api=api, weight_layout=layout, **props)


def _weight_layout(props, storage, rounding, api, fsdp2_sharded, half_params=False):
    """Who owns the weights. O2 with fp32 masters rounded as torch casts, under amp_patch's own API: the model's
    fp32 params are the masters and the forward uses half compute copies (one owner). Remainder masters, the split
    rounding, Apex's API (its scripts inspect ``param.dtype`` and ``_amp_stash``) and a model that comes in with
    half params (its params would be half masters) keep half model params plus fp32 masters beside them (two
    copies). Models sharded by FSDP2 at a half level: its policy casts them."""
    half = props["cast_model_type"] in HALF_DTYPES
    if fsdp2_sharded and half:
        return "fsdp2"
    if not (half and props["master_weights"]):
        return "none"
    if storage == "fp32" and rounding == "nearest" and api == "amp_patch" and not half_params:
        return "one_owner"
    return "two_copy"


def _check_master_storage(opt_level, master_weights):
    """``master_weights``: True/False/None (Apex) or ``"remainder"`` (O2, bf16): 'fp32' or 'remainder'."""
    if master_weights is None or isinstance(master_weights, bool):
        return "fp32"
    if master_weights != "remainder":
        raise ConfigError(f"master_weights={master_weights!r}; allowed: True, False, None (the opt level's default) "
                          "or 'remainder' (O2 with bfloat16: bf16 weights plus int16 remainders as exact masters)")
    if opt_level != "O2":
        raise ConfigError(f"master_weights='remainder' with opt_level={opt_level!r}: remainder masters are a way "
                          "to hold O2's fp32 master weights, which only O2 has. Use opt_level='O2', "
                          "half_dtype=torch.bfloat16")
    return "remainder"


def _check_master_rounding(rounding, storage, props, half_dtype):
    """``master_rounding``: how fp32 masters are rounded to the half model ('nearest' or 'split')."""
    if rounding is None:
        return "split" if storage == "remainder" else "nearest"
    if rounding not in ("nearest", "split"):
        raise ConfigError(f"master_rounding={rounding!r}; allowed: 'nearest' (torch's round-to-nearest-even copy, "
                          "the default) or 'split' (round half away from zero on the low 16 bits, as "
                          "master_weights='remainder' does)")
    if storage == "remainder" and rounding != "split":
        raise ConfigError("master_rounding='nearest' with master_weights='remainder': the remainder masters round "
                          "by the split rule only; drop master_rounding, or use master_weights=True")
    if rounding == "split" and not (props["master_weights"] and half_dtype is torch.bfloat16
                                    and props["cast_model_type"] is torch.bfloat16):
        raise ConfigError("master_rounding='split' applies to fp32 master weights copied to a bfloat16 model "
                          "(opt_level='O2', half_dtype=torch.bfloat16, master_weights=True); drop it here")
    return rounding


def _resolve_half_dtype(half_dtype, cast_model_type):
    half_dtype = None if half_dtype is None else parse_half_dtype(half_dtype)  # also "fp16", "bf16-mixed", ...
    if cast_model_type not in (None, False, torch.float32) + HALF_DTYPES:
        raise ConfigError(f"cast_model_type={cast_model_type!r}; allowed: torch.float32, torch.float16, "
                          "torch.bfloat16, False (do not cast the model) or None (the opt level's default)")
    if cast_model_type in HALF_DTYPES:
        if half_dtype is not None and half_dtype is not cast_model_type:
            raise ConfigError(f"cast_model_type={cast_model_type} and half_dtype={half_dtype} disagree; "
                              "pass only one of them")
        return cast_model_type
    return half_dtype or torch.float16


def _check_module_types(types_):
    if isinstance(types_, type):  # one class, as isinstance() accepts it
        types_ = (types_,)
    if not isinstance(types_, (tuple, list, set, frozenset)) and types_ is not None:
        raise ConfigError(f"keep_fp32_modules={types_!r}; pass a tuple of nn.Module subclasses, e.g. "
                          "keep_fp32_modules=(torch.nn.LayerNorm,)")
    types_ = tuple(types_ or ())
    for t in types_:
        if not (isinstance(t, type) and issubclass(t, torch.nn.Module)):
            raise ConfigError(f"keep_fp32_modules must hold nn.Module subclasses (e.g. torch.nn.LayerNorm); "
                              f"got {t!r}")
    return types_
