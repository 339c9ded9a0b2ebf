"""The registry of every process-wide patch: what amp_patch may patch besides op-list sites, and what is patched now.

Every attribute amp_patch replaces anywhere in the process goes through a :class:`~amp_patch.patching.patcher.
Patcher`, which registers itself here while it holds a patch; :func:`installed` lists them (the tests' leak check
requires it to be empty after each test). Op-list sites (``torch.*``, ``torch.nn.functional.*``, ``torch.Tensor.*``
and user registrations) are data in the op lists; :data:`CATALOGUE` lists the others, with their owner and why.
"""
CATALOGUE = (
    # (site, owner module, why)
    ("torch.optim.optimizer.Optimizer.zero_grad", "session.api",
     "a skipped step's grads are cleared with the optimizer's own zero_grad; O2 clears the masters' grads too"),
    ("<optimizer class>.step", "session.api",
     "each optimizer class that defines step() (casting pauses inside it; the scale_loss protocol finishes there)"),
    ("torch.nn.utils.clip_grad.clip_grad_norm_/clip_grad_value_ (also in torch.nn.utils)", "weights.clip_check",
     "two-copy O2 only (remainder, split, apex alias): clipping model params whose masters hold the grads warns once"),
    ("torch.optim.optimizer.Optimizer._amp_stash", "legacy.amp_stash",
     "Apex's per-optimizer stash, read by Apex scripts (added while an apex-alias session is open)"),
    ("torch.optim.optimizer.Optimizer._lazy_init_maybe_master_weights", "legacy.amp_stash", "Apex's name, a no-op"),
    ("torch.nn.modules.rnn.RNNBase.check_input", "casting.interop.modules",
     "the dtype part of RNN input checks answers for the cast dtype while the _VF wrapper casts"),
    ("<class of each model passed>.forward", "session.call_guard",
     "a forward cut off by Ctrl-C (a BaseException that is not an Exception) runs the session's always-called "
     "forward hooks as it unwinds, as torch runs them for an Exception; other instances call straight through "
     "(only a class defining forward itself as a plain function)"),
    ("torch.nn.modules.module.Module.load_state_dict", "casting.interop.modules",
     "O1: a forward of the thread cut off by Ctrl-C is forgotten first (its casts of the old weights go)"),
    ("torch._C._is_any_autocast_enabled", "casting.interop.native_regions",
     "hybrid O1 engine: RNN input checks see native autocast as the Python path leaves it (off) in a fast region"),
    *((site, "casting.native_plan",
       "hybrid O1 engine: runs with native autocast off in a fast region (its C++ composite reaches an op native "
       "autocast casts and no wrapper sees: padding, mm/matmul)")
      for site in ("torch._C._nn.pad", "torch.cov", "torch.corrcoef", "torch.tensordot", "torch.bilinear",
                   "torch.matrix_power", "torch.chain_matmul", "torch.Tensor.cov", "torch.Tensor.corrcoef",
                   "torch.Tensor.matrix_power", "torch._C._linalg.linalg_matrix_power",
                   "torch._C._linalg.linalg_multi_dot", "torch._C._linalg.linalg_pinv", "torch.linalg.matrix_power",
                   "torch.linalg.multi_dot", "torch.linalg.pinv", "torch.einsum", "torch.inner", "torch.Tensor.inner",
                   "torch.nn.functional.bilinear")),
    ("<native autocast's entries the op list lacks>", "casting.native_plan",
     "hybrid O1 engine: each runs with native autocast off in a fast region, as uncast as under the Python engine"),
    ("warnings._showwarnmsg", "casting.interop.warn_site", "a warning torch raises in a wrapped op names the caller"),
    ("torch.utils.checkpoint.CheckpointFunction.apply", "casting.interop.recompute",
     "reentrant checkpoint recompute runs with the forward's casting state"),
    ("torch.utils.checkpoint._checkpoint_without_reentrant_generator(_impl)", "casting.interop.recompute",
     "non-reentrant checkpoint recompute runs with the forward's casting state"),
    ("torch.utils.checkpoint.CheckpointFunction.apply", "model.recompute_copies",
     "O2: a reentrant checkpoint's recompute re-enters the model call its forward ran in (its compute copies)"),
    ("torch.utils.checkpoint._checkpoint_without_reentrant_generator(_impl)", "model.recompute_copies",
     "O2: a non-reentrant checkpoint's recompute re-enters the model call its forward ran in"),
    ("torch.nn.modules.module.Module._apply", "model.conversion_guard",
     "O2 (fp32 params, half compute copies): model.half()/.to(half) of an O2 model is refused (it would train half)"),
    ("torch.amp.autocast_mode.autocast.__enter__", "casting.interop.native_regions",
     "torch.autocast(enabled=False) regions turn amp_patch's casting off too"),
    ("torch.amp.autocast_mode.autocast.__exit__", "casting.interop.native_regions", "(the region's end)"),
    ("torch.is_autocast_enabled", "casting.interop.native_regions",
     "custom_fwd/custom_bwd functions see casting on inside a session"),
    ("torch.utils.data.dataloader._SingleProcessDataLoaderIter._next_data", "session.data_loading",
     "a num_workers=0 fetch runs with casting off, as in DataLoader workers (the data pipeline never casts)"),
    ("torch.nn.parallel.distributed.DistributedDataParallel.__init__", "parallel.ddp",
     "O2 masters follow DDP's broadcast of rank 0's weights"),
    ("torch.nn.parallel.distributed.DistributedDataParallel.no_sync", "parallel.ddp",
     "unscaling inside no_sync() is counted, so an unreduced step is refused"),
    ("torch._dynamo.config.skip_nnmodule_hook_guards", "model.compile_guards",
     "O2's compute copies: compiled graphs guard on module hooks (set False while the session is open)"),
    ("torch.Tensor.item/tolist/cpu/numpy/__bool__/__int__/__float__/__repr__/__format__", "tools.speed.probes",
     "only during `amp-patch speed` probe steps, not in a session: counts the user's host reads of tensor values"),
)

_live = {}  # id(patcher) -> the patcher, while it holds at least one patch (insertion order: oldest first)


def register(patcher):
    _live[id(patcher)] = patcher


def forget(patcher):
    _live.pop(id(patcher), None)


def installed():
    """Every patch installed now, oldest patcher first: a list of ``"module.attribute"`` site names."""
    return [site for patcher in list(_live.values()) for site in patcher.sites()]
