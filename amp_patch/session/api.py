"""The Apex-compatible entry points: initialize and deinitialize (the session's readings: accessors.py; scale_loss:
scale_loss.py)."""
import functools
import logging
import types
import weakref

import torch

from .._torch import hooks
from ..casting.engine import CastingEngine
from ..casting.interop import modules as module_compat
from ..config.dtypes import HALF_DTYPES
from ..config.opt_levels import resolve
from ..errors import ConfigError
from ..model import conversion_guard, recompute_copies
from ..model.compile_guards import HookGuards
from ..model.transform import ModelPatch, SparseEmbedding
from ..observe.overflow import OverflowDiagnoser, StepHistory
from ..observe.trace import Tracer
from ..parallel import ddp as distributed
from ..patching import early_bound
from ..patching.patcher import Patcher
from ..scaling.optimizer_state import OptimizerState
from ..weights import clip_check
from ..weights.compute_copies import check_no_calls_elsewhere
from ..weights.storage import make_storage
from . import call_guard, data_loading, nested_models
from . import state as _state
from .checks import (  # noqa: F401
    _check_enabled,
    _check_models,
    _check_not_initialized,
    _check_optimizers_train_models,
    _check_the_rest,
    _make_scalers,
    _pack,
    as_list,
    check_cast_engine,
    check_incoming_fp32,
    check_no_inner_optimizers,
    check_no_lazy_params,
    check_no_shared_params,
    check_step_hooks,
    engine_for,
    hybrid_device_types,
    uncompiled,
)
from .scale_loss import check_idle_elsewhere
from .session import Session
from .step_outcome import finish_delayed
from .user_functions import REGISTRY

log = logging.getLogger("amp_patch")


def initialize(models, optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None, loss_scale=None,
               cast_model_outputs=None, num_losses=1, verbosity=1, min_loss_scale=None, max_loss_scale=2.0 ** 24,
               *, half_dtype=None, op_lists=None, allow_banned=False, growth_factor=2.0, backoff_factor=0.5,
               growth_interval=2000, hysteresis=1, keep_fp32_modules=(), log_all_ranks=False,
               diagnose_overflow=False, history_size=1000, allow_incoming_model_not_fp32=False,
               master_rounding=None, cast_engine="hybrid"):
    """Set up mixed precision for ``models`` and ``optimizers`` (Apex's signature plus keyword-only extras).

    Returns the models and optimizers in the structure they were passed (only
    the models when no optimizers were given). See docs/usage.md.
    """
    return open_session(locals(), api="amp_patch")


def open_session(call, api):
    """``initialize`` with its arguments as a mapping (every parameter of :func:`initialize`) under ``api``'s
    rules (``"amp_patch"``, or ``"apex"`` for the alias: see ``Properties.api``)."""
    c = types.SimpleNamespace(**call)
    _check_not_initialized()
    _check_enabled(c.enabled)
    if c.models is None:
        raise ConfigError("models=None; pass the model(s) to set up: initialize(model, optimizer, opt_level=...)")
    model_list = uncompiled(as_list(c.models, "models", torch.nn.Module))
    opt_list = as_list(c.optimizers, "optimizers", torch.optim.Optimizer)
    if not c.enabled:
        _state.activate(Session(enabled=False))
        return _pack(c.models, c.optimizers)
    check_step_hooks(opt_list)
    _check_models(model_list)
    check_incoming_fp32(model_list, c.allow_incoming_model_not_fp32)
    check_cast_engine(c.cast_engine)
    props = _resolve(c, api, model_list)
    check_no_lazy_params(props, model_list)
    fsdp_groups, unsharded = distributed.check_fsdp_at_initialize(model_list, props, c.master_weights)
    # every argument is checked before anything is touched: a ConfigError leaves the models as they were
    _check_optimizers_train_models(props, model_list, opt_list)
    check_no_shared_params(props, opt_list, model_list)
    check_no_inner_optimizers(props, opt_list)
    scalers = _make_scalers(props, c.num_losses, c.min_loss_scale, c.max_loss_scale, c.growth_factor,
                            c.backoff_factor, c.growth_interval, c.hysteresis)
    table = _check_the_rest(props, c.history_size, c.op_lists, model_list)
    session = Session(props)
    session.grad_enabled = torch.is_grad_enabled()  # what undoing a failed (or interrupted) initialize leaves
    session.parallel.fsdp_groups = fsdp_groups
    try:
        _build(session, model_list, opt_list, scalers, table, c.allow_banned, c.log_all_ranks,
               engine_for(c.cast_engine, model_list))
        session.parallel.unsharded_models = unsharded
        _set_up_diagnostics(session, model_list, c.diagnose_overflow, c.history_size)
        _log_configuration(props, c.verbosity)
        _commit(session)
    except BaseException:
        _abandon(session)
        raise
    return _pack(c.models, c.optimizers)


def _resolve(c, api, model_list):
    """The session's policy, resolved once from the arguments and the facts about the models."""
    return resolve(c.opt_level, half_dtype=c.half_dtype, keep_fp32_modules=c.keep_fp32_modules,
                   cast_model_type=c.cast_model_type, patch_torch_functions=c.patch_torch_functions,
                   keep_batchnorm_fp32=c.keep_batchnorm_fp32, master_weights=c.master_weights,
                   loss_scale=c.loss_scale, cast_model_outputs=c.cast_model_outputs,
                   master_rounding=c.master_rounding, api=api,
                   fsdp2_sharded=distributed.any_sharded(model_list),
                   half_params=any(p.dtype in HALF_DTYPES for m in model_list for p in m.parameters()))


def _build(session, model_list, opt_list, scalers, table, allow_banned, log_all_ranks, cast_engine="hybrid"):
    """The steps of initialize that change something; each registers its undo before (or as) it acts."""
    session.undo.append(distributed.install_rank_filter(log_all_ranks))
    fp32_data = _prepare_models(session, model_list)
    nested_models.install(session, model_list)  # a model passed with its own submodule: Apex's casts
    if not opt_list and session.props.two_copy:  # optimizers attached later (attach_optimizers) get exact
        session.fp32_data = fp32_data  # masters; until then the model's state_dict()/load_state_dict() use these
    attach_optimizer_states(session, opt_list, fp32_data)
    _guard_zero_grad(session)
    _warn_clipping_model_params(session)
    link_masters(session)
    session.scaling.scalers = scalers
    hybrid = hybrid_device_types(model_list) if cast_engine == "hybrid" else ()
    _install_casting(session, table, allow_banned, hybrid=hybrid)
    _reach_early_bound(session, model_list)
    _attach_scopes(session, model_list)
    _guard_step_pause(session, model_list)
    guard = call_guard.CallGuard()  # Ctrl-C in a forward ends the call as a raise does
    session.undo.append(guard.undo)  # first: an interrupt right after a patch leaves nothing behind
    guard.install(model_list)


def _commit(session):
    """The session becomes the active one; the models stop keeping their pre-initialize fp32 values."""
    _state.activate(session, session.casting.engine)
    session.grad_enabled = None  # deinitialize leaves the grad mode it is called in
    for patch in session.casting.model_patches:
        patch.commit()


def _abandon(session):
    """Undo a failed initialize: every undo step runs (see Session.close). Should one fail too, the session stays
    current so that ``deinitialize()`` retries it (logged); the caller re-raises the original error."""
    if _state.current() is session:
        _state.deactivate()
    try:
        session.close()
    except BaseException:  # noqa: B036 - the initialize error is the one to report
        _state.activate(session)
        log.exception("undoing the failed amp_patch.initialize() failed too; call amp_patch.deinitialize()")


def _guard_zero_grad(session):
    """``optimizer.zero_grad()`` also clears the half model grads (O2) and the pending scale (all levels), so
    after a failed batch it forgets that batch as it would without amp_patch (Apex patched each optimizer)."""
    if not session.scaling.opt_states:
        return
    patcher = Patcher()

    def make(original):
        @functools.wraps(original)
        def zero_grad(self, *args, **kwargs):
            state = session.scaling.opt_states.get(id(self))
            ours = state is not None and state.optimizer is self
            if ours and state.zero_grads_in_place:  # Apex's O2 zero_grad (the alias, legacy/amp_stash.py)
                args, kwargs = (), {"set_to_none": False}
            result = original(self, *args, **kwargs)
            if ours:
                state.on_zero_grad()
                engine = session.casting.engine
                if engine is not None and engine.paused:  # a step() that raised left O1 casting paused in this thread
                    engine.resume_after_step()
            return result
        return zero_grad

    session.undo.append(patcher.restore_all)  # first: an interrupt right after install leaves nothing behind
    patcher.install(torch.optim.Optimizer, "zero_grad", make)
    for state in session.scaling.opt_states.values():
        if state.pairs and type(state.optimizer).zero_grad is not torch.optim.Optimizer.zero_grad:
            log.warning("%s overrides zero_grad(); after a failed batch also call model.zero_grad() "
                        "to clear the half model grads", type(state.optimizer).__name__)


def _warn_clipping_model_params(session):
    """Two-copy O2: ``clip_grad_norm_(model.parameters())`` clips nothing; warned once (weights/clip_check.py)."""
    patcher = Patcher()
    session.undo.append(patcher.restore_all)  # first: an interrupt right after install leaves nothing behind
    clip_check.install(session.props, session.scaling.opt_states, patcher)


def _prepare_models(session, models):
    """Cast models (O0/O2/O3) and their inputs/outputs; returns the fp32 data of params cast to half."""
    props = session.props
    fp32_data = {}
    fp64 = props.cast_float64_io  # the apex alias: Apex's to_type casts float64 model inputs/outputs too
    if props.model_cast is None:  # O1: outputs cast only when cast_model_outputs is given (as Apex)
        _cast_outputs_only(session, models, props.cast_model_outputs, fp64)
        return fp32_data
    keep = props.keep_fp32_modules
    if props.keep_batchnorm_fp32:
        keep = keep + (torch.nn.modules.batchnorm._BatchNorm,)
    copies = props.weight_layout == "one_owner"
    if copies:  # (a sparse grad cannot flow back through a compute copy)
        keep = keep + (SparseEmbedding,)
        guards = HookGuards()
        session.undo.append(guards.restore)  # first: an interrupt inside install leaves nothing behind
        guards.install()
        recompute = Patcher()
        session.undo.append(recompute.restore_all)
        recompute_copies.install(recompute)
        conversion_guard.install(recompute)
    for model in models:
        patch = ModelPatch(model)
        session.casting.model_patches.append(patch)
        session.undo.append(lambda patch=patch: patch.restore(_restore_values(session, patch)))
        fp32_data.update(patch.cast(props.model_cast, keep, params=not copies))
        patch.cast_io(props.model_cast, props.cast_model_outputs or torch.float32, keep,
                      compute_copies=copies, fp64=fp64)
    return fp32_data


def _cast_outputs_only(session, models, output_dtype, fp64):
    """Uncast models (O1) with ``cast_model_outputs``: their outputs are cast to it, as Apex's patched forward."""
    if output_dtype is None:
        return
    for model in models:
        patch = ModelPatch(model)
        session.casting.model_patches.append(patch)
        session.undo.append(patch.restore)
        patch.cast_outputs(output_dtype, fp64)


def _restore_values(session, patch):
    """What the cast params get back at deinitialize: their masters, else the fp32 values kept for
    attach_optimizers (a session with no optimizer, e.g. Lightning's validate), on the param's device."""
    values = {**session.fp32_data, **session.scaling.masters()}
    return {pid: values[pid].to(param.device) for pid, (param, _) in patch.original_dtypes.items() if pid in values}


def _trains_unscaled(props):
    """The opt level under which a plain backward (scale_loss forgotten) trains without its float16 loss scale, or
    None: O1, O2 where the fp32 params are the only weights, and O3 (no masters) (see
    scaling/forgotten_scale_loss.py)."""
    scaled = props.half_dtype is torch.float16 and (props.dynamic or props.loss_scale != 1.0)
    one_owner = props.opt_level in ("O1", "O3") or props.weight_layout == "one_owner"
    return props.opt_level if scaled and one_owner else None


def attach_optimizer_states(session, optimizers, fp32_data):
    for opt in optimizers:
        props = session.props
        state = OptimizerState(opt, master_weights=props.two_copy,
                               fp32_data=fp32_data, storage=make_storage(props.master_storage, props.master_rounding),
                               unscaled_warning=_trains_unscaled(props),
                               attach=False)
        session.scaling.opt_states[id(opt)] = state
        session.undo.append(state.restore)  # before attach: an interrupt inside it is undone too
        state.finish = functools.partial(_finish_delayed, weakref.ref(session))  # (no cycle through the session)
        state.attach(fp32_data)


def _finish_delayed(session_ref, state, scaler, found_inf):
    session = session_ref()
    return session is not None and finish_delayed(session, state, scaler, found_inf)


def link_masters(session):
    """state_dict()/load_state_dict() use the masters, or the kept fp32 data of params no optimizer holds yet
    (called again by attach_optimizers: the later hooks, with the masters, decide)."""
    masters = session.scaling.masters()
    to_model = _model_rounding(session)
    for patch in session.casting.model_patches:
        patch.link_state_dict({**session.fp32_data, **masters}, to_model)
    if masters:
        distributed.track_no_sync(session)
        distributed.follow_ddp_broadcast(session)  # DDP built later: masters follow rank 0


def _model_rounding(session):
    """For loading a model state_dict: the half value a param gets from its master, by its optimizer's rule
    (None when every master is rounded as torch casts: the loaded value is then cast by torch itself)."""
    states = [s for s in session.scaling.opt_states.values() if s.pairs]
    if all(s.storage.persistent and s.storage.rounding == "nearest" for s in states):
        return None
    owner = {id(p): s for s in states for p, _ in s.pairs}
    return lambda param, master: owner[id(param)].to_model(param, master) if id(param) in owner else master


def _install_casting(session, table, allow_banned, hybrid=()):
    props = session.props
    if table is None:
        return
    if table.skipped:  # version-dependent entries are declared, never silently dropped
        log.info("%d op-list entr%s skipped on torch %s: %s", len(table.skipped),
                 "y" if len(table.skipped) == 1 else "ies", torch.__version__,
                 "; ".join(f"{s.entry.qualname} ({s.entry.path}:{s.entry.line}: {s.reason})" for s in table.skipped))
    engine = session.casting.engine = CastingEngine(table, half_dtype=props.half_dtype, allow_banned=allow_banned,
                                                    registrations=REGISTRY.take(), activation=_state.ACTIVATION,
                                                    hybrid=hybrid)
    session.undo.append(engine.uninstall)
    engine.install()
    patcher = Patcher()
    session.undo.append(patcher.restore_all)  # first: an interrupt right after a patch leaves nothing behind
    data_loading.install(engine, patcher)
    module_compat.relax_rnn_input_check(engine, patcher)
    module_compat.forget_cut_off_forward_on_load(engine, patcher)
    for state in session.scaling.opt_states.values():
        state.engine = engine


def _reach_early_bound(session, models):
    if session.casting.engine is None:
        return
    session.models = models
    session.refresh_early_bound()
    session.undo.append(session.casting.drop_early_bound)
    session.unreachable = early_bound.scan_globals(models, session.casting.engine)


def _attach_scopes(session, models):
    """Module-scoped op lists (the op list's ``scopes:``) apply inside the models' matching modules."""
    if session.casting.engine is not None:
        session.casting.engine.attach_scopes(models)


def _guard_step_pause(session, models):
    """O1 pauses casting inside optimizer.step() (its pre-hook); post-hooks do not run when step() raises, so the
    step of each optimizer class in the session ends the pause in a ``finally`` (a class-level patch, undone by
    deinitialize). Forwards of the models and scale_loss resume too."""
    engine = session.casting.engine
    if engine is None:
        return
    resume, paused = engine.resume_after_step, engine.paused
    begin_forward, end_forward = engine.begin_forward, engine.end_forward
    for model in models:  # (begin_forward also drops the cast cache: see casting.wrappers.CastCache)
        session.undo.append(hooks.forward_pre_hook(model, hooks.call_on_forward(begin_forward)).remove)
        session.undo.append(hooks.forward_hook(model, hooks.call_on_forward(end_forward), always_call=True).remove)
    patcher = Patcher()
    session.undo.append(patcher.restore_all)

    def make(original):
        @functools.wraps(original)  # also copies torch's ``hooked`` flag, so torch does not wrap it again
        def step(self, *args, **kwargs):
            try:
                return original(self, *args, **kwargs)
            finally:
                if paused:  # (the step's post-hook resumed already, unless step() raised)
                    resume()
        return step

    for cls in dict.fromkeys(type(state.optimizer) for state in session.scaling.opt_states.values()):
        if "step" in vars(cls):
            patcher.install(cls, "step", make)


def _set_up_diagnostics(session, models, diagnose_overflow, history_size):
    session.observe.history = StepHistory(history_size)
    session.models = models  # (a skipped step's cause names the params with non-finite grads)
    if not diagnose_overflow:
        return
    tracer, engine = None, session.casting.engine
    if engine is not None:  # the recording wrappers tell which op produced a bad output
        tracer = Tracer(modules=False, unpatched=False)
        engine.retrace(tracer)
        session.refresh_early_bound()
    session.observe.diagnoser = OverflowDiagnoser(models, session.props.half_dtype, tracer,
                                                  quiet=engine.casts_disabled if engine else None)
    session.undo.append(session.observe.diagnoser.remove)


def _log_configuration(props, verbosity):
    if verbosity:
        log.info("opt_level %s, half dtype %s, cast_model_type %s, patch_torch_functions %s, "
                 "keep_batchnorm_fp32 %s, master_weights %s, loss_scale %s", props.opt_level,
                 props.half_dtype, props.cast_model_type, props.patch_torch_functions, props.keep_batchnorm_fp32,
                 "remainder" if props.master_storage == "remainder" else props.master_weights, props.loss_scale)


def deinitialize():
    """Undo ``initialize``: remove every patch and hook, restore models and optimizers. Safe to call twice.

    Every undo step runs even if one fails (or is interrupted); the session then stays current with the steps
    that failed, so calling ``deinitialize()`` again finishes the job. It also finishes the closing of an
    ``autocast()`` region that an interrupt cut short."""
    _state.finish_closes()
    session = _state.current()
    if session is None:
        return  # an open autocast() region (no session) keeps its engine: it removes its own patches on exit
    check_idle_elsewhere(session)
    check_no_calls_elsewhere()
    closed = False
    try:
        _state.deactivate()
        session.close()
        closed = True
    finally:
        if not closed:  # (no engine: casting stays off) a second deinitialize() retries what failed
            _state.activate(session)
