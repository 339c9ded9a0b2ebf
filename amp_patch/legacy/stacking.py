"""``apex.amp.initialize`` called more than once: each call adds its models and optimizers to what is active.

Apex kept no session: every ``amp.initialize`` call cast its own models and patched its own optimizers, and
replaced the process-wide loss scalers (``_amp_state.loss_scalers``, ``num_losses`` fresh ones) and
properties. GAN scripts rely on it (``netG, optG = amp.initialize(netG, optG)`` then the same for ``netD``).
amp_patch has one session per process, so a second call with the same options rebuilds the session over the
union of the models and optimizers (earlier ones first): the earlier models and optimizers keep training, their
weights, fp32 masters and optimizer state carry over exactly, and the loss scalers are the second call's fresh
ones (as Apex's were). The result is the session one call over all of them would have made.

A second call whose options differ (another opt level, cast type, master weights, ...) cannot be reproduced:
Apex applied the new level's patches process-wide on top of the old ones. amp_patch then closes the open
session (its models and optimizers back to fp32, no longer managed) with a warning, and starts the new one;
the earlier optimizers' ``scale_loss`` then raises. (Apex's own unit tests do exactly this between opt levels.)

Per session, ``session.extensions["apex"]`` records what this layer needs to rebuild it: the keyword arguments
of the calls so far and the old-API handles (``amp.init()``) bound to it.
"""
import inspect
import logging

import torch

from ..config.opt_levels import resolve
from ..errors import UsageError
from ..scaling.stages import Grads
from ..session import state as _state
from ..session.api import check_incoming_fp32, deinitialize, open_session
from ..session.api import initialize as _initialize
from . import amp_lists, amp_stash

log = logging.getLogger("amp_patch")
_SIGNATURE = inspect.signature(_initialize)
_COMPARED = ("opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights",
             "cast_model_outputs", "half_dtype", "keep_fp32_modules")
_RESOLVE_ARGS = ("half_dtype", "keep_fp32_modules", "cast_model_type", "patch_torch_functions",
                 "keep_batchnorm_fp32", "master_weights", "loss_scale", "cast_model_outputs")


def record(session):
    """This layer's record of ``session``: {"calls": merged initialize kwargs, "handles": [AmpHandle, ...]}."""
    return session.extensions.setdefault("apex", {"calls": {}, "handles": []})


def initialize(*args, **kwargs):
    """Apex's ``amp.initialize``, adding to an open session (see the module docstring)."""
    call = _SIGNATURE.bind(*args, **kwargs).arguments
    models, optimizers = call.pop("models"), call.pop("optimizers", None)
    session = _state.current()
    if session is not None and _compatible(session, call):
        return _add_to(session, models, optimizers, call)
    if session is not None:
        _close_incompatible(session, call)
    result = open_apex_session(models, optimizers, with_list_edits(call))
    _opened(_state.current(), dict(call), [])
    return result


def open_apex_session(models, optimizers, call):
    """``initialize(models, optimizers, **call)`` under Apex's rules (``Properties.api == "apex"``: the two-copy O2
    layout Apex scripts inspect, Apex's scaler counting, float64 inputs/outputs cast; docs/migration.md)."""
    bound = _SIGNATURE.bind(models, optimizers, **call)
    bound.apply_defaults()
    return open_session(bound.arguments, api="apex")


def _opened(session, calls, handles):
    """What this layer adds to a session it opened: its record, and Apex's optimizer internals."""
    now = record(session)
    now["calls"], now["handles"] = calls, handles
    for handle in handles:
        handle._session = session
    if session.enabled:
        amp_stash.install(session)


def with_list_edits(call):
    """``call`` with the edits of ``apex.amp.lists`` added to its ``op_lists`` (O1: the level that patches)."""
    if call.get("enabled", True) is False or not _props_of(call).patch_torch_functions:
        return call
    base = "apex" if call.get("op_lists") is None else call["op_lists"]  # the alias keeps Apex's lists as default
    edited = amp_lists.overlay(base)
    return {**call, "op_lists": edited}


def _props_of(call):
    options = {name: call[name] for name in _RESOLVE_ARGS if name in call}
    return resolve(call.get("opt_level", "O1"), **options)


def _compatible(session, call):
    """Can the open session take this call's models and optimizers (same enabled state, same options)?"""
    enabled = call.get("enabled", True)
    if not session.enabled or enabled is False:
        return session.enabled is enabled
    new = _props_of(call)
    return all(getattr(new, name) == getattr(session.props, name) for name in _COMPARED)


def _describe(session):
    return f"opt_level {session.props.opt_level!r}" if session.enabled else "enabled=False"


def _close_incompatible(session, call):
    log.warning("amp.initialize(opt_level=%r%s) while a session with %s is open: amp_patch cannot mix different "
                "amp options in one process (Apex applied the new call's patches process-wide), so the open "
                "session is closed first: its models and optimizers get their fp32 params back and are no longer "
                "managed (their scale_loss raises). Initialize every model with the same options to train them "
                "together, or call amp.deinitialize() between runs to say so explicitly.",
                call.get("opt_level", "O1"), "" if call.get("enabled", True) else ", enabled=False",
                _describe(session))
    deinitialize()


def as_list(objs):
    if objs is None:
        return []
    return list(objs) if isinstance(objs, (list, tuple)) else [objs]


def _check_nothing_pending(session):
    for state in session.scaling.opt_states.values():
        if state.in_scale_loss or state.grads is Grads.SCALED:
            raise UsageError(f"amp.initialize() called again while the {type(state.optimizer).__name__} "
                             "optimizer has scaled gradients waiting for step() (inside scale_loss, or after a "
                             "delay_unscale=True exit); call optimizer.step() (or optimizer.zero_grad()) first, "
                             "then initialize the new models")


def _union(session, new_models, new_optimizers):
    """(models, optimizers) of the rebuilt session: the open ones first, then the new ones. An earlier optimizer
    over params a new optimizer also holds is replaced by it (the Hugging Face Trainer builds a new optimizer for
    the same model on every train())."""
    models = list(session.models)
    known = {id(m) for m in models}
    models += [m for m in new_models if id(m) not in known]
    new_params = {id(p) for opt in new_optimizers for group in opt.param_groups for p in _model_params(group)}
    new_ids = {id(opt) for opt in new_optimizers}
    kept = []
    for state in session.scaling.opt_states.values():
        opt = state.optimizer
        if id(opt) in new_ids:
            continue
        overlap = any(id(p) in new_params for p in _state_model_params(state))
        if overlap:
            log.info("amp.initialize(): the new %s optimizer holds params of the earlier %s optimizer, which it "
                     "replaces (no longer managed)", type(new_optimizers[0]).__name__, type(opt).__name__)
        else:
            kept.append(opt)
    return models, kept + list(new_optimizers)


def _model_params(group):
    return group["params"]


def _state_model_params(state):
    """The model params an open optimizer trains (its masters' model params under O2)."""
    model_of = {id(master): p for p, master in state.pairs}
    return [model_of.get(id(p), p) for group in state.optimizer.param_groups for p in group["params"]]


def _add_to(session, models, optimizers, call):
    """Rebuild the session over the open models/optimizers plus this call's; returns them as passed."""
    new_models, new_optimizers = as_list(models), as_list(optimizers)
    if not session.enabled:
        return models if optimizers is None else (models, optimizers)
    _check_nothing_pending(session)
    fresh = [m for m in new_models if isinstance(m, torch.nn.Module) and m not in session.models]
    check_incoming_fp32(fresh, call.get("allow_incoming_model_not_fp32", False))
    all_models, all_optimizers = _union(session, new_models, new_optimizers)
    kept = record(session)
    merged = {**kept["calls"], **call, "allow_incoming_model_not_fp32": True}  # (the new models were checked)
    deinitialize()
    try:
        open_apex_session(all_models, all_optimizers, with_list_edits(merged))
    except BaseException:
        log.error("amp.initialize() could not add the new models to the open session; the earlier models and "
                  "optimizers were restored to fp32 and are no longer managed")
        raise
    _opened(_state.current(), {**kept["calls"], **call}, kept["handles"])
    log.info("amp.initialize() added %d model(s) and %d optimizer(s) to the open session (now %d and %d); the loss "
             "scalers are this call's fresh ones, as in Apex", len(fresh), len(new_optimizers), len(all_models),
             len(all_optimizers))
    return models if optimizers is None else (models, optimizers)
