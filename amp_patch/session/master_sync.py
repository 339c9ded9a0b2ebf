"""The public master-weight sync under DDP: ``broadcast_master_params`` and ``masters_out_of_sync``
(``amp_patch.distributed``); they find the active session's optimizer states and work on their master pairs."""
import torch

from .._torch.dist import world
from ..errors import UsageError
from . import state as _state


def _master_pairs():
    session = _state.current()
    if session is None or not session.enabled:
        raise UsageError("amp_patch.distributed.broadcast_master_params() needs an initialized session; call "
                         "amp_patch.initialize(...) first, then wrap the model in DistributedDataParallel")
    return [(state, model_p, master) for state in session.scaling.opt_states.values()
            for model_p, master in state.public_pairs()]


def broadcast_master_params(src=0, group=None):
    """Give every rank rank ``src``'s fp32 master params (and the half model params cast from them).

    DDP broadcasts rank 0's *model* params when it is constructed; under O2 those
    are the half copies and the fp32 masters held by the optimizer keep each
    rank's own values. Call this once after wrapping the model when the ranks
    did not build identical weights (different seeds, a checkpoint loaded on one
    rank only). A no-op outside a multi-rank run and for opt levels without
    master weights. Collective: every rank of ``group`` must call it.
    """
    pairs = _master_pairs()
    dist = world()
    if dist is None or not pairs:
        return
    with torch.no_grad():
        for state, model_p, master in pairs:
            value = master.detach()  # a real fp32 master's own storage, or a remainder master joined
            dist.broadcast(value, src=src, group=group)
            master.copy_(value)
            model_p.copy_(state.to_model(model_p, master))


def masters_out_of_sync():
    """Names (``"param i"``) of this rank's master params that do not round to their half model param.

    Local and cheap (no collective). A non-empty answer after wrapping in DDP
    means DDP overwrote the half params with rank 0's and the fp32 masters were
    left behind: call :func:`broadcast_master_params`.
    """
    bad = []
    for i, (state, model_p, master) in enumerate(_master_pairs()):
        if state.out_of_sync(model_p, master):
            bad.append(f"param {i}")
    return bad
