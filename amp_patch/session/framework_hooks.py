"""Hooks for training frameworks that own the loop (Lightning's Trainer and Fabric, see
amp_patch.integrations.lightning).

Such a framework wraps the model in DDP *before* it builds the optimizers, while
amp_patch must cast the model before DDP wraps it. So the integration calls
``initialize(model)`` without optimizers first (under master weights the session
then keeps the fp32 values of the params it cast) and ``attach_optimizers`` once the
optimizers exist. Fabric only shows the plugin an optimizer at its first step or
clip, after the first backward: ``unscale_loss_id`` hands over the gradients that
backward left scaled.
"""
import torch

from .._torch import dist as distributed
from ..errors import UsageError
from ..scaling.stages import DOOMED
from .api import as_list, attach_optimizer_states, link_masters
from .checks import check_no_inner_optimizers, check_no_shared_params, check_step_hooks, held_params
from .state import current_session
from .step_outcome import finish_step, quiet


def attach_optimizers(optimizers, *, unscale_loss_id=None):
    """Add optimizers to the session of an earlier ``initialize(models)``; returns them unchanged.

    Under master weights a half param gets an fp32 master holding the exact value it had before
    ``initialize`` cast it (on the param's current device) when ``initialize`` got no optimizers; otherwise
    (an optimizer added to a full session) its master starts from the half value. ``unscale_loss_id``: the grads
    now in these optimizers' params come from a backward of ``loss * loss_scale(unscale_loss_id)`` run outside
    ``scale_loss``; they are unscaled and checked now, as a ``scale_loss`` exit would (an overflow skips the
    next ``step()``).
    """
    session = current_session("attach_optimizers")
    opt_list = as_list(optimizers, "optimizers", torch.optim.Optimizer)
    if not session.enabled:
        return optimizers
    check_step_hooks(opt_list)
    for opt in opt_list:
        if id(opt) in session.scaling.opt_states:
            raise UsageError(f"this {type(opt).__name__} optimizer is already attached to the amp_patch session; "
                             "attach each optimizer once (initialize(model, opt) or attach_optimizers(opt))")
    attached = [(state.optimizer, [p for pair in state.pairs for p in pair] + held_params(state.optimizer))
                for state in session.scaling.opt_states.values()]
    check_no_shared_params(session.props, opt_list, session.models, attached)
    check_no_inner_optimizers(session.props, opt_list)
    _follow_devices(session.fp32_data, opt_list)
    attach_optimizer_states(session, opt_list, session.fp32_data)
    states = [session.scaling.state_for(opt) for opt in opt_list]
    for state in states:
        state.engine = session.casting.engine
    link_masters(session)
    if unscale_loss_id is not None:
        _unscale_now(session, states, unscale_loss_id)
    return optimizers


def _follow_devices(fp32_data, optimizers):
    """The model may have moved to its device since initialize kept the fp32 values: move them along."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                data = fp32_data.get(id(p))
                if data is not None and data.device != p.device:
                    fp32_data[id(p)] = data.to(p.device)


def _unscale_now(session, states, loss_id):
    scaler = session.scaling.scaler(loss_id)
    with quiet(session):
        found_inf = False
        for state in states:
            state.adopt_scaled(scaler)
            found_inf |= state.after_backward(scaler, False)
        finish_step(session, scaler, loss_id, states, distributed.agree_overflow(found_inf))


def next_step_skipped(optimizer):
    """True when ``optimizer``'s next ``step()`` will be skipped (an overflow was found since its last step)."""
    session = current_session("next_step_skipped")
    return session.enabled and session.scaling.state_for(optimizer).next_step is DOOMED
