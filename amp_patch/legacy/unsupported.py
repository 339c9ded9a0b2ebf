"""Apex features amp_patch does not provide, and what to use instead.

An entry of :data:`UNSUPPORTED` for a whole module (``"parallel"``, ``"optimizers"``, ...)
applies only while amp_patch has no mirror of that module (:mod:`amp_patch.legacy.mirror`):
once amp_patch provides ``apex.X``, ``apex.X`` is served and only names it lacks raise.

Looking one up raises :class:`ApexAttributeError` (an ``AttributeError``, for
``apex.amp.X`` / ``handle.X``) or :class:`ApexImportError` (a
``ModuleNotFoundError``, for ``import apex.X``), both :class:`~amp_patch.AmpPatchError`
subclasses whose message names the feature and the alternative, so
``try: from apex.optimizers import FusedAdam / except ImportError:`` fallbacks keep working.
"""
from ..errors import AmpPatchError

_DOCS = "See docs/migration.md."
_PUBLIC = ("the public API: amp.initialize, amp.scale_loss, amp.master_params, amp.state_dict/load_state_dict, "
           "amp.register_half/float/promote_function, amp.disable_casts")
_OTHER_APEX = ("NVIDIA apex itself (the alias then leaves its modules alone and adds only the apex modules it "
               "lacks), or the native torch equivalent")

# name relative to ``apex`` -> (what the feature is, what to use instead)
UNSUPPORTED = {
    "amp.rnn_compat": ("apex.amp.rnn_compat (Apex's internal RNN patching)",
                       "nothing: amp_patch's O1 casts nn.LSTM/GRU/RNN through its op lists (docs/op_lists.md); "
                       "delete the call"),
    "amp.scaler": ("apex.amp.scaler (Apex's LossScaler class)",
                   "amp.state_dict()/amp.load_state_dict() for the scale, amp_patch.loss_scale(loss_id) to read it"),
    "amp.LossScaler": ("apex.amp.LossScaler", "amp.state_dict() or amp_patch.loss_scale(loss_id)"),
    "amp.AmpHandle": ("apex.amp.AmpHandle (constructing the old handle directly)", "handle = amp.init(...)"),
    "amp.NoOpHandle": ("apex.amp.NoOpHandle", "handle = amp.init(enabled=False)"),
    "amp.OptimWrapper": ("apex.amp.OptimWrapper (constructing it directly)",
                         "optimizer = amp.init().wrap_optimizer(optimizer, num_loss=N)"),
    "amp.Properties": ("apex.amp.frontend.Properties (Apex's option object)",
                       "keyword arguments of amp.initialize (opt_level=..., loss_scale=..., ...)"),
    "amp.opt_properties": ("apex.amp.opt_properties", "apex.amp._amp_state.opt_properties"),
    "optimizers": ("apex.optimizers (FusedAdam, FusedLAMB, FusedSGD, FusedNovoGrad)",
                   "torch.optim.AdamW(params, fused=True) / torch.optim.Adam(fused=True) / "
                   "torch.optim.SGD(fused=True) (foreach=True on CPU)"),
    "parallel": ("apex.parallel (DistributedDataParallel, SyncBatchNorm, convert_syncbn_model)",
                 "torch.nn.parallel.DistributedDataParallel (after amp.initialize) and "
                 "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)"),
    "normalization": ("apex.normalization (FusedLayerNorm, FusedRMSNorm)", "torch.nn.LayerNorm / torch.nn.RMSNorm"),
    "fp16_utils": ("apex.fp16_utils (FP16_Optimizer, network_to_half, FP16Model)",
                   "amp.initialize(model, optimizer, opt_level='O2') (half model, fp32 master weights)"),
    "RNN": ("apex.RNN", "torch.nn.LSTM / torch.nn.GRU (O1 casts them)"),
    "reparameterization": ("apex.reparameterization (weight norm)", "torch.nn.utils.parametrizations.weight_norm"),
    "multi_tensor_apply": ("apex.multi_tensor_apply", "torch._foreach_* ops"),
    "contrib": ("apex.contrib (Apex's CUDA extensions: fused attention, group norm, optimizers, ...)",
                "NVIDIA apex itself (the alias then leaves its modules alone), or the native torch equivalent"),
    "transformer": ("apex.transformer (Megatron-style tensor/pipeline parallelism)",
                    "Megatron-Core or torch.distributed.tensor.parallel"),
    "mlp": ("apex.mlp (fused MLP)", "torch.nn.Sequential of torch.nn.Linear and activations"),
    "fused_dense": ("apex.fused_dense", "torch.nn.Linear"),
    "pyprof": ("apex.pyprof", "torch.profiler"),
}
_INTERNAL_AMP = ("amp", "frontend", "_initialize", "_process_optimizer", "handle", "opt", "wrap", "utils", "compat",
                 "_amp_state", "rnn_compat", "scaler", "__version__")


class ApexFeatureError(AmpPatchError):
    """An Apex feature amp_patch does not provide; ``feature`` and ``alternative`` say which and what instead."""

    def __init__(self, feature, alternative):
        self.feature = feature
        self.alternative = alternative
        super().__init__(f"{feature} is not supported by amp_patch's Apex compatibility layer; use "
                         f"{alternative} instead. {_DOCS}")


class ApexAttributeError(ApexFeatureError, AttributeError):
    """Raised for ``apex.amp.<unsupported>`` attribute access (hasattr() still answers False)."""


class ApexImportError(ApexFeatureError, ModuleNotFoundError):
    """Raised for ``import apex.<unsupported>`` (``except ImportError`` fallbacks still work)."""


def describe(name):
    """(feature, alternative) for ``name`` relative to ``apex`` (e.g. ``"optimizers.FusedAdam"``)."""
    parts = name.split(".")
    provided = _provided_ancestor(parts)
    if provided is not None:
        return (f"apex.{name} (amp_patch provides apex.{provided}, but not this)",
                f"the names apex.{provided} has (docs/migration.md lists them), {_OTHER_APEX}")
    for cut in range(len(parts), 0, -1):
        known = UNSUPPORTED.get(".".join(parts[:cut]))
        if known is not None:
            if cut == len(parts):
                return known
            return f"apex.{name} ({known[0]})", known[1]
    if parts[0] == "amp":
        if len(parts) > 1 and parts[1] in _INTERNAL_AMP:
            return f"apex.{name} (an Apex-internal module)", _PUBLIC
        return f"apex.{name}", f"{_PUBLIC} (apex.amp has no {parts[-1]!r})"
    return f"apex.{name} (not part of apex.amp)", _OTHER_APEX


def _provided_ancestor(parts):
    """The longest proper prefix of ``parts`` that amp_patch's mirror provides (e.g. "parallel"), or None."""
    from .mirror import has_mirror

    if parts[0] == "amp":
        return None
    for cut in range(len(parts) - 1, 0, -1):
        if has_mirror("apex." + ".".join(parts[:cut])):
            return ".".join(parts[:cut])
    return None


def missing_name_error(module_name, name, module):
    """``module_name.name`` where amp_patch provides ``module_name`` but it has no ``name``."""
    names = getattr(module, "__all__", None) or sorted(k for k in vars(module) if not k.startswith("_"))
    return ApexAttributeError(f"{module_name}.{name} (amp_patch's {module_name} has: {', '.join(names)})",
                              f"one of those names, {_OTHER_APEX}")


def attribute_error(name):
    return ApexAttributeError(*describe(name))


def import_error(name):
    return ApexImportError(*describe(name))
