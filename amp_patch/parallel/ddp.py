"""DDP and FSDP2 helpers: rank-0 logging, DDP's no_sync and broadcast followed, FSDP2 checks.

The readings of torch.distributed (world size, rank, the overflow all-reduce) are in :mod:`amp_patch._torch.dist`;
the public master-weight sync (``broadcast_master_params``) in :mod:`amp_patch.session.master_sync`.

Nothing here imports or initializes a process group; every function is a cheap
no-op unless ``torch.distributed`` is available, initialized and has >1 rank.

Rules the helpers rely on (see docs/distributed.md):

* every rank calls ``scale_loss`` (and ``optimizer.step()`` after a delayed
  unscale) the same number of times, because each non-delayed ``scale_loss``
  exit all-reduces the overflow flag (one scalar, MAX) over the default group;
* DDP wraps the model *after* ``initialize``; under master weights (O2) DDP's
  construction broadcast reaches the half model params only, so ranks must start
  from identical weights or call :func:`broadcast_master_params` after wrapping.
"""
import contextlib
import functools
import inspect
import logging

import torch

from .._torch import dist
from ..errors import UsageError
from ..patching.patcher import Patcher

log = logging.getLogger("amp_patch")


class RankZeroFilter(logging.Filter):
    """Drops amp_patch log records on ranks other than 0."""

    def filter(self, record):
        return dist.rank() == 0


def install_rank_filter(all_ranks):
    """Add the rank-0 filter to the amp_patch logger; returns a callable that removes it."""
    if all_ranks:
        return lambda: None
    flt = RankZeroFilter()
    log.addFilter(flt)
    return lambda: log.removeFilter(flt)


def check_unscale_inside_no_sync(model, delay_unscale):
    """Raise UsageError for a non-delayed ``scale_loss`` exit inside ``model.no_sync()`` (``model`` a DDP module).

    DDP reduces ``param.grad`` as it stands at the next synced backward, but a
    non-delayed exit moves the local, never-reduced grads out of ``param.grad``
    (into the accumulation stash or the fp32 master grads) before that backward
    runs: each rank would then step with its own gradients and the replicas drift
    apart. Inside ``no_sync()`` pass ``delay_unscale=True``. ``model=None`` or a
    model that is not DDP: nothing to check.
    """
    if delay_unscale or model is None or getattr(model, "require_backward_grad_sync", True):
        return
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or dist.world() is None:
        return
    raise UsageError("scale_loss(..., delay_unscale=False) inside DistributedDataParallel.no_sync(): these local "
                     "gradients would be unscaled and moved out of param.grad before DDP reduces it, so every rank "
                     "would step with different gradients. Pass delay_unscale=True for the micro-batches inside "
                     "no_sync() and unscale (delay_unscale=False) on the synced last one.")


def track_no_sync(session):
    """Patch ``DistributedDataParallel.no_sync`` to count, in ``session.parallel.no_sync_depth``, the open ``no_sync()``
    regions; the undo goes on ``session.undo`` before the patch is installed (a Ctrl-C in between leaves nothing).

    Under master weights a non-delayed ``scale_loss`` exit would move the local grads out of ``param.grad``
    before DDP's next synced backward reduces them. While a region is open, ``scale_loss`` leaves them scaled in
    ``param.grad`` instead (as ``delay_unscale=True`` does), so legacy loops that never pass ``delay_unscale``
    or ``model=`` accumulate correctly. Counting every DDP module is safe: a deferred unscale is finished by
    the next non-delayed exit or by ``step()``.
    """
    _patch_ddp(session, "no_sync", lambda original: _counting_no_sync(original, session))


def follow_ddp_broadcast(session):
    """Patch ``DistributedDataParallel.__init__`` so that the fp32 masters follow the weights DDP broadcasts.

    DDP gives every rank rank 0's *model* params when it is built; under O2 those are the half copies, and the
    masters made at ``initialize`` would keep each rank's own values (scripts that seed each rank differently,
    e.g. NVIDIA's BERT pre-training, then train different weights per rank). Apex made its masters at the first
    backward, after that broadcast; here, right after DDP's own broadcast, the masters of the wrapped module's
    params are broadcast from the same source rank (collective, as DDP's construction is), and the half params
    re-cast from them. Nothing happens for ``init_sync=False`` (DDP broadcasts nothing then). The undo goes on
    ``session.undo``.
    """
    _patch_ddp(session, "__init__", lambda original: _syncing_init(original, session))


def _patch_ddp(session, name, make_replacement):
    """Patch ``DistributedDataParallel.<name>`` for the session (nothing without torch.distributed); its undo is on
    ``session.undo`` first, so an interrupt right after the install leaves nothing behind."""
    if not torch.distributed.is_available():
        return
    patcher = Patcher()
    session.undo.append(patcher.restore_all)
    patcher.install(torch.nn.parallel.DistributedDataParallel, name, make_replacement)


def _syncing_init(original, session):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if signature.bind(self, *args, **kwargs).arguments.get("init_sync", True):
            _broadcast_module_masters(self, session)

    return __init__


def _broadcast_module_masters(ddp, session):
    """Give the masters of ``ddp.module``'s params (not those DDP ignores) DDP's source rank's values, and their
    model params the half values the session's rounding rule gives (remainder masters: split, as they store)."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    wanted = {id(p) for name, p in ddp.module.named_parameters() if name not in ignored}
    pairs = [(state, model_p, master) for state in session.scaling.opt_states.values()
             for model_p, master in state.public_pairs() if id(model_p) in wanted]
    if not pairs:
        return
    group = ddp.process_group
    src = torch.distributed.get_global_rank(group, 0)
    values = [master.detach() for _, _, master in pairs]
    flat = torch._utils._flatten_dense_tensors(values)
    torch.distributed.broadcast(flat, src=src, group=group)
    with torch.no_grad():
        for (state, model_p, master), value in zip(pairs, torch._utils._unflatten_dense_tensors(flat, values)):
            master.copy_(value)
            model_p.copy_(state.to_model(model_p, master))


def _counting_no_sync(original, session):
    @functools.wraps(original)
    @contextlib.contextmanager
    def no_sync(self):
        with original(self):
            session.parallel.no_sync_depth += 1
            try:
                yield
            finally:
                session.parallel.no_sync_depth -= 1

    return no_sync


# -- FSDP2 (torch.distributed.fsdp.fully_shard) ---------------------------------------------------------------
def _is_sharded(model):
    from .fsdp2 import is_sharded
    return is_sharded(model)


def check_fsdp_at_initialize(models, props, master_weights=None):
    """``(FSDP2 param groups, models to watch for a later shard)`` (see :func:`amp_patch.parallel.fsdp2.check_sharded`).

    O2/O3 on a model sharded with a compatible MixedPrecisionPolicy (``amp_patch.fully_shard``): no cast and no
    master copy; other sharded models are refused at O2/O3 with the policy to use.
    """
    from .fsdp2 import check_sharded
    return check_sharded(models, props, master_weights), [m for m in models if not _is_sharded(m)]


def any_sharded(models):
    """Whether FSDP2 shards any of ``models`` (a fact the policy is resolved from)."""
    return any(_is_sharded(m) for m in models)


def fsdp_accumulating(session, scaler, loss_id):
    """True while ``set_requires_gradient_sync(False)`` keeps the session's FSDP2 grads unreduced: they
    accumulate inside FSDP2, out of ``param.grad``, so the scale_loss exit is delayed to the synced micro-batch.

    Those grads carry the scale of the loss that produced them and amp_patch cannot rescale them there, so one
    accumulation must use one loss id (refused otherwise)."""
    off = any(not group.reduce_grads for group in session.parallel.fsdp_groups)
    held = session.parallel.fsdp_held
    if held is not None and held[0] is not scaler:
        raise UsageError(f"scale_loss(..., loss_id={loss_id}) while FSDP2 holds gradients that micro-batches under "
                         f"set_requires_gradient_sync(False) accumulated from loss_id={held[1]}; they are scaled "
                         "by that loss's scale inside FSDP2, where amp_patch cannot rescale them. Use one loss_id "
                         "for the micro-batches of one accumulation (or scale their sum: scale_loss(loss0 + loss1, "
                         "optimizer)), or sync before switching loss ids.")
    session.parallel.fsdp_held = (scaler, loss_id) if off else None
    return off


def check_not_sharded_since_initialize(models):
    """UsageError when ``fully_shard`` ran on a model after ``initialize`` (checked at the first scale_loss)."""
    if any(_is_sharded(m) for m in models):
        raise UsageError("fully_shard() was applied to the model after amp_patch.initialize(): the optimizer (and "
                         "under O2 the fp32 masters) still hold the unsharded parameters, so nothing would train. "
                         "Shard first, then build the optimizer and initialize: fully_shard(...); optimizer = "
                         "torch.optim.AdamW(model.parameters()); model, optimizer = amp_patch.initialize(model, "
                         "optimizer, opt_level='O1')")
