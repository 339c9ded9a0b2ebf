"""The checks ``initialize`` runs before it changes anything (moved out of frontend.py unchanged): every argument
is validated here first, so a ConfigError or UsageError leaves the models, optimizers and torch as they were."""
import itertools
import logging
import sys

import torch

from ..casting.interop.native_regions import engine_device_type
from ..config.dtypes import HALF_DTYPES
from ..config.oplist import default_list_name, load_op_lists
from ..errors import ConfigError, UsageError
from ..parallel import ddp as distributed
from ..scaling.scaler import LossScaler
from ..weights.layouts import kept_fp32_ids
from . import state as _state

log = logging.getLogger("amp_patch")

_WRAPPERS = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)


def _check_not_initialized():
    if _state.current() is not None:
        raise UsageError("amp_patch.initialize() was already called; call amp_patch.deinitialize() before "
                         "initializing again (initialize once, with every model and optimizer)")
    if _state.active_engine() is not None:
        raise UsageError("amp_patch.initialize() inside an open amp_patch.autocast() region; initialize first "
                         "(an O1 session makes autocast() regions no-ops) or close the region")



def _check_enabled(enabled):
    """A string is always true: ``initialize(model, opt, "O2")`` would silently run O1."""
    if isinstance(enabled, str):
        raise ConfigError(f"enabled={enabled!r}; allowed: True or False. The third positional argument is "
                          f"'enabled'; pass the opt level by name: initialize(model, optimizer, opt_level={enabled!r})")



def _check_optimizers_train_models(props, models, optimizers):
    """O2/O3 cast the models passed: an optimizer over none of their params would train other weights."""
    if props.model_cast not in (torch.float16, torch.bfloat16):
        return
    model_params = {id(p) for m in models for p in m.parameters()}
    for opt in optimizers:
        params = [p for g in opt.param_groups for p in g["params"]]
        if params and not any(id(p) in model_params for p in params):
            raise ConfigError(f"{type(opt).__name__} optimizer holds {len(params)} param(s), none of which belong "
                              f"to the model(s) passed to initialize(opt_level={props.opt_level!r}); it would "
                              "train weights the half model never uses. Build it over model.parameters() of the "
                              "model you pass, or pass that model too: initialize([model1, model2], optimizer)")



def held_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def check_no_shared_params(props, optimizers, models, attached=()):
    """Under master weights each optimizer keeps its own fp32 master of each param it holds: two optimizers over
    one param would train two masters, and each step() would copy its own into the param (wrong numbers).
    ``attached``: (optimizer, the params it holds: model params and their masters) of a running session."""
    if not props.two_copy:  # (one owner: the params are the masters)
        return
    names = {id(p): n for m in models for n, p in m.named_parameters()}
    owner = {}
    for opt, params in [*attached, *((opt, held_params(opt)) for opt in optimizers)]:
        for p in params:
            first = owner.setdefault(id(p), opt)
            if first is not opt:
                name = names.get(id(p), f"of shape {tuple(p.shape)}")
                raise ConfigError(
                    f"two optimizers ({type(first).__name__} and {type(opt).__name__}) hold the same param "
                    f"{name!r} under master weights (opt_level={props.opt_level!r}): each would keep its own fp32 "
                    "master of it and the half param would get only the last step()'s update. Give each param to "
                    "one optimizer, or use one optimizer with param groups (e.g. SGD([{'params': a}, "
                    "{'params': b, 'lr': 1e-3}]))")


def check_no_inner_optimizers(props, optimizers):
    """The two-copy layout (``master_weights="remainder"``, ``master_rounding="split"``, the apex alias) puts the fp32
    masters into the optimizer's own param groups. An optimizer that steps another optimizer it built over the
    params with groups of its own (``ZeroRedundancyOptimizer``, a sharding wrapper) would step the half model
    params and the masters would never move: refused, naming the layout that can."""
    if not props.two_copy:
        return
    for opt in optimizers:
        held = {id(p) for p in held_params(opt)}
        groups = {id(g) for g in opt.param_groups}
        for name, inner in vars(opt).items():
            if not isinstance(inner, torch.optim.Optimizer) or inner is opt:
                continue
            if any(id(g) not in groups and any(id(p) in held for p in g["params"]) for g in inner.param_groups):
                raise UsageError(
                    f"{type(opt).__name__} steps an inner optimizer ({name!r}, a {type(inner).__name__}) with param "
                    "groups of its own; this O2 layout (master_weights='remainder', master_rounding='split' or "
                    "the apex alias: half model params, fp32 masters in the optimizer's groups) gives the masters "
                    "only to the outer optimizer, so the inner one would step the half params and the masters would "
                    "never move. Use O2 with the default master_weights=True from amp_patch (not the apex alias): "
                    "the fp32 model params are then the masters and any optimizer steps them")


def as_list(objs, what, kind):
    if objs is None:
        return []
    items = list(objs) if isinstance(objs, (list, tuple)) else [objs]
    for obj in items:
        if not isinstance(obj, kind):
            raise ConfigError(f"{what} must be a {kind.__module__}.{kind.__qualname__} or a list of them; got "
                              f"{type(obj).__name__}")
    if len({id(o) for o in items}) != len(items):
        raise ConfigError(f"the same object appears twice in {what}; pass each once")
    return items



def check_step_hooks(optimizers):
    """amp_patch unscales and skips steps through torch's step hooks, which ``Optimizer.__init__`` sets up."""
    for index, opt in enumerate(optimizers):
        if hasattr(opt, "_optimizer_step_pre_hooks") and hasattr(opt, "_optimizer_step_post_hooks"):
            continue
        name = type(opt).__name__
        raise ConfigError(
            f"optimizers[{index}] ({name}) is a torch.optim.Optimizer subclass whose __init__ did not call "
            "Optimizer.__init__, so it has none of torch's step hooks (_optimizer_step_pre_hooks), which amp_patch "
            "uses to unscale the grads and skip overflowed steps. Fix: call super().__init__(params, defaults) in "
            f"{name}.__init__ (a wrapper: super().__init__(inner.param_groups, inner.defaults) first), or pass "
            f"the inner optimizer it wraps to amp_patch.initialize instead (and build the {name} over it after)")


def _pack(models, optimizers):
    return models if optimizers is None else (models, optimizers)



def _check_models(models):
    for model in models:
        if isinstance(model, _WRAPPERS):
            raise UsageError(f"the model is already wrapped in {type(model).__name__}; call amp_patch.initialize() "
                             f"on the bare model first, then wrap it: model = {type(model).__name__}(model, ...)")



def check_no_lazy_params(props, models):
    """O2 and O3 cast or copy the weights that exist at initialize: a lazy module's uninitialized ones cannot be."""
    if props.cast_model_type is None:
        return
    lazy = (torch.nn.parameter.UninitializedParameter, torch.nn.parameter.UninitializedBuffer)
    for model in models:
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
            if isinstance(tensor, lazy):
                raise UsageError(f"{name!r} of the {type(model).__name__} is not initialized yet (a lazy module, "
                                 f"e.g. nn.LazyLinear): opt_level={props.opt_level!r} casts the weights that exist "
                                 "at initialize. Run one forward pass first (model(example_batch)), then create the "
                                 "optimizer and call amp_patch.initialize")


def uncompiled(models):
    """The models ``torch.compile(model)`` wrapped, in place of their wrappers: amp_patch sets up the model itself
    (its hooks then run inside the compiled region, as for a model compiled after ``initialize``); the caller gets
    the wrapper back and calls it as before."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # (not imported: nothing was compiled)
    if eval_frame is None:
        return models
    wrapper = eval_frame.OptimizedModule
    return [model._orig_mod if isinstance(model, wrapper) else model for model in models]


def engine_for(cast_engine, models):
    """``cast_engine``, except that a model holding a compiled submodule (``torch.compile(layer)`` inside an eager
    forward) gets the Python engine for the default hybrid one: the hybrid engine turns native autocast on for the
    forward, and dynamo refuses to trace a frame while that state is not its own ("Global autocast state changed
    while dynamo tracing"). The Python engine casts the same bits (it is the hybrid engine's oracle)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if cast_engine != "hybrid" or eval_frame is None:
        return cast_engine
    compiled = [name for model in models for name, module in model.named_modules()
                if isinstance(module, eval_frame.OptimizedModule)]
    if compiled:
        log.info("amp_patch: compiled submodule %r inside the model: O1 casts with the Python engine "
                 "(cast_engine='python'; the same casts, each op in Python)", compiled[0])
        return "python"
    return cast_engine


def check_incoming_fp32(models, allow):
    """Apex refused a model that arrives in half: its weights would have no fp32 values to train from."""
    if allow or _state.allow_incoming_model_not_fp32():
        return
    for model in models:
        if distributed._is_sharded(model):
            continue  # FSDP2: the policy's dtypes are checked after resolve (check_fsdp_at_initialize)
        named = [("parameter", n, t) for n, t in model.named_parameters()]
        named += [("buffer", n, t) for n, t in model.named_buffers()]
        for kind, name, tensor in named:
            if tensor is not None and tensor.dtype in HALF_DTYPES:
                raise UsageError(
                    f"{kind} {name!r} of the {type(model).__name__} passed to initialize is {tensor.dtype}; expected "
                    "torch.float32. Do not call .half() (or .to(torch.float16/bfloat16)) on the model before "
                    "initialize, whatever the opt level: O2/O3 cast it themselves and O2 keeps fp32 master weights. "
                    "Pass the fp32 model; if a half model is intended, pass allow_incoming_model_not_fp32=True "
                    "(Apex scripts: apex.amp._amp_state.allow_incoming_model_not_fp32 = True)")



def _make_scalers(props, num_losses, min_loss_scale, max_loss_scale, growth_factor, backoff_factor,
                  growth_interval, hysteresis):
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ConfigError(f"num_losses={num_losses!r}; pass the number of losses you scale, a positive integer")
    return [LossScaler(props.loss_scale, loss_id=i, min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
                       growth_factor=growth_factor, backoff_factor=backoff_factor,
                       growth_interval=growth_interval, hysteresis=hysteresis) for i in range(num_losses)]



def models_device_type(models):
    """The device type of the models' first parameter or buffer (none: where the engine casts, cuda or cpu)."""
    for model in models:
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            return tensor.device.type
    return engine_device_type()


def _load_table(props, op_lists, models):
    """The op table of an O1 session (None at other levels), loaded and validated before anything is patched;
    without ``op_lists``, native autocast's list for the models' device (``default_list_name``)."""
    if not props.patch_torch_functions:
        if op_lists is not None:
            raise ConfigError(f"op_lists only apply when torch functions are patched (opt_level='O1'); "
                              f"opt_level={props.opt_level!r} does not patch. Drop op_lists or use O1.")
        return None
    return load_op_lists(op_lists, default=default_list_name(models_device_type(models)))



def _check_the_rest(props, history_size, op_lists, models):
    """The last checks before initialize changes anything; returns the op table."""
    if isinstance(history_size, bool) or not isinstance(history_size, int) or history_size < 1:
        raise ConfigError(f"history_size={history_size!r}; pass a positive number of steps to keep")
    _check_kept_inside_attention(props, models)
    return _load_table(props, op_lists, models)


def _check_kept_inside_attention(props, models):
    """A kept module that a half ``MultiheadAttention`` reads without calling it (its ``out_proj``, a ``Linear``
    subclass) cannot run fp32: the attention's functional forward would mix its fp32 weight with half activations."""
    keep = props.keep_fp32_modules
    if not keep or props.model_cast not in HALF_DTYPES:
        return
    for model in models:
        kept = kept_fp32_ids(model, keep)
        for name, module in model.named_modules():
            attention = isinstance(module, torch.nn.MultiheadAttention)
            if attention and id(module) not in kept and id(module.out_proj) in kept:
                where = f"{name}.out_proj" if name else "out_proj"
                raise ConfigError(
                    f"keep_fp32_modules={keep!r} keeps {where!r} ({type(module.out_proj).__name__}), which its "
                    f"MultiheadAttention {name or type(model).__name__!r} reads without calling it, in half: it "
                    "cannot run fp32 on its own. Keep the attention too (add torch.nn.MultiheadAttention to "
                    "keep_fp32_modules), or keep a narrower type than the one that matches out_proj")


def check_cast_engine(cast_engine):
    if cast_engine not in CAST_ENGINES:
        raise ConfigError(f"cast_engine={cast_engine!r}; allowed: 'hybrid' (the default: native autocast casts the "
                          "ops whose category is native's inside the models' forwards, Python wrappers the rest) or "
                          "'python' (every op of the list cast by its Python wrapper; see docs/architecture.md)")


CAST_ENGINES = ("hybrid", "python")


def hybrid_device_types(models):
    """The device types of the models' params and buffers: where the hybrid engine turns native autocast on."""
    found = {t.device.type for m in models for t in itertools.chain(m.parameters(), m.buffers())}
    return tuple(sorted(found)) or (engine_device_type(),)
