"""Apex opt levels on FSDP2 (``torch.distributed.fsdp.fully_shard``): sharding plans and the initialize check.

FSDP2's ``MixedPrecisionPolicy`` is O2's data layout: the sharded fp32 params are the master weights (no second
copy), ``param_dtype`` gives the half compute params, ``reduce_dtype=float32`` the fp32 master grads and
``cast_forward_inputs`` / ``output_dtype`` the input and output casts. :func:`fully_shard` translates an opt level
into those policies and shards bottom-up; :func:`check_sharded` (called by ``initialize``) checks the policy of a
sharded model and tells ``initialize`` not to cast it and to keep no master copy. Nothing here touches a process
group until ``fully_shard`` is called; sharding (like DDP wrapping) is not undone by ``deinitialize``.
"""
import dataclasses
import itertools
import logging

import torch

from .._torch.compat import TESTED
from ..config.dtypes import HALF_DTYPES
from ..config.opt_levels import resolve
from ..errors import ConfigError, TorchVersionError, UsageError

__all__ = ["fully_shard"]

log = logging.getLogger("amp_patch")
_BATCHNORM = torch.nn.modules.batchnorm._BatchNorm
_FIX = ("shard with amp_patch.fully_shard(model, opt_level={level!r}, wrap=(Block,)), or give every half "
        "fully_shard call mp_policy=MixedPrecisionPolicy(param_dtype={half}, reduce_dtype=torch.float32)")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The policies one opt level gives each kind of FSDP2 group (None: plain fully_shard, no policy)."""

    block: object
    root: object
    kept: object  # user-named fp32 modules: fp32 inputs and params, half outputs
    batchnorm: object  # kept batchnorm: fp32 params on the half input (as O2 runs it unsharded)
    keep_types: tuple
    cast_to: object  # O3: the module's params are cast to this dtype before sharding


def fully_shard(module, *, opt_level="O2", half_dtype=None, keep_batchnorm_fp32=None, keep_fp32_modules=(),
                cast_model_outputs=None, mesh=None, reshard_after_forward=True, wrap=None):
    """Shard ``module`` with torch's ``fully_shard`` under the policies of Apex's ``opt_level``; returns it.

    Bottom-up: kept-fp32 modules (batchnorm per ``keep_batchnorm_fp32``, the classes in ``keep_fp32_modules``)
    each get an fp32 group, the modules ``wrap`` selects (a class, a tuple of classes or a callable
    ``module -> bool``) a half group, and the root a half group whose outputs are cast to
    ``cast_model_outputs`` (default float32, as Apex). O2: fp32 sharded params (the masters), half compute,
    fp32 reduction. O3: the params are cast to half first (no masters), half reduction. O0/O1: no policy.
    Then build the optimizer over ``module.parameters()`` and call ``amp_patch.initialize`` with the same level.
    """
    _check_module(module)
    plan = _plan(opt_level, half_dtype, keep_batchnorm_fp32, keep_fp32_modules, cast_model_outputs)
    selects = _wrap_predicate(wrap)
    kwargs = {"mesh": mesh, "reshard_after_forward": _check_reshard(reshard_after_forward)}
    shard = _torch_fully_shard()
    if plan.cast_to is not None:
        _cast_for_o3(module, plan)
    for child in _bottom_up(module, plan.keep_types):
        policy = _policy_for(child, plan, selects)
        if policy is not False and _has_params(child):
            shard(child, **kwargs, **_mp(policy))
    shard(module, **kwargs, **_mp(plan.root))
    return module


def _torch_fully_shard():
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError("amp_patch.fully_shard() needs a process group; call torch.distributed."
                         "init_process_group(...) first (torchrun sets the environment for it)")
    from torch.distributed.fsdp import fully_shard as shard
    return shard


def _check_module(module):
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"amp_patch.fully_shard() expects an nn.Module; got {type(module).__name__}")
    if is_sharded(module):
        raise UsageError(f"the {type(module).__name__} passed to amp_patch.fully_shard() is already (partly) "
                         "sharded by fully_shard; pass the unsharded model and let amp_patch.fully_shard shard it "
                         "bottom-up (its blocks through wrap=...)")
    for name, tensor in list(module.named_parameters()):
        if tensor.dtype is not torch.float32:
            raise UsageError(f"parameter {name!r} is {tensor.dtype}; amp_patch.fully_shard() expects the float32 "
                             "model (O2 keeps the fp32 sharded params as masters, O3 casts them itself). Do not "
                             "call .half() before sharding.")


def _plan(opt_level, half_dtype, keep_batchnorm_fp32, keep_fp32_modules, cast_model_outputs):
    from torch.distributed.fsdp import MixedPrecisionPolicy as Policy

    props = resolve(opt_level, half_dtype=half_dtype, keep_fp32_modules=keep_fp32_modules,
                    keep_batchnorm_fp32=keep_batchnorm_fp32, cast_model_outputs=cast_model_outputs)
    half = props.cast_model_type
    if half not in HALF_DTYPES:
        if props.keep_fp32_modules or cast_model_outputs is not None or keep_batchnorm_fp32 is not None:
            raise ConfigError(f"opt_level={props.opt_level!r} does not cast the model, so keep_fp32_modules, "
                              "keep_batchnorm_fp32 and cast_model_outputs do not apply to sharding; drop them or "
                              "use opt_level='O2'")
        return _Plan(None, None, None, None, (), None)
    if cast_model_outputs is not None and cast_model_outputs not in HALF_DTYPES + (torch.float32,):
        raise ConfigError(f"cast_model_outputs={cast_model_outputs!r}; allowed: torch.float32, torch.float16, "
                          "torch.bfloat16 or None (float32, as Apex)")
    reduce = torch.float32 if props.master_weights else half
    block = Policy(param_dtype=half, reduce_dtype=reduce)
    root = Policy(param_dtype=half, reduce_dtype=reduce, output_dtype=cast_model_outputs or torch.float32)
    keep = props.keep_fp32_modules + ((_BATCHNORM,) if props.keep_batchnorm_fp32 else ())
    return _Plan(block=block, root=root, batchnorm=Policy(cast_forward_inputs=False),
                 kept=Policy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=half),
                 keep_types=keep, cast_to=None if props.master_weights else half)


def _wrap_predicate(wrap):
    if wrap is None:
        return lambda module: False
    if isinstance(wrap, type) or (isinstance(wrap, (tuple, list)) and wrap):
        types_ = tuple(wrap) if isinstance(wrap, (tuple, list)) else (wrap,)
        if all(isinstance(t, type) and issubclass(t, torch.nn.Module) for t in types_):
            return lambda module: isinstance(module, types_)
    elif callable(wrap):
        return lambda module: bool(wrap(module))
    raise ConfigError(f"wrap={wrap!r}; pass the block classes to shard as groups (wrap=(TransformerBlock,)), a "
                      "callable module -> bool, or None (only kept-fp32 modules and the root)")


def _check_reshard(value):
    if isinstance(value, bool) or (isinstance(value, int) and value > 1) or value is None:
        return value
    raise ConfigError(f"reshard_after_forward={value!r}; allowed: True, False, None or an int > 1 (torch's "
                      "fully_shard: reshard to that smaller world size)")


def _mp(policy):
    return {} if policy is None else {"mp_policy": policy}


def _bottom_up(module, keep_types):
    """Submodules of ``module`` (not itself), children before parents; kept-fp32 modules are leaves."""
    order = []

    def visit(parent):
        for child in parent.children():
            if not (keep_types and isinstance(child, keep_types)):
                visit(child)
            order.append(child)

    visit(module)
    return order


def _policy_for(module, plan, selects):
    """The policy of ``module``'s group, or False to leave it to its parent's group."""
    if plan.keep_types and isinstance(module, plan.keep_types):
        return plan.batchnorm if isinstance(module, _BATCHNORM) else plan.kept
    return plan.block if selects(module) else False


def _has_params(module):
    return any(True for _ in module.parameters())


def _cast_for_o3(module, plan):
    """O3: half params and buffers (no masters) except in kept-fp32 modules, before sharding (not undone)."""
    kept = {id(t) for m in module.modules() if plan.keep_types and isinstance(m, plan.keep_types)
            for t in itertools.chain(m.parameters(), m.buffers())}
    with torch.no_grad():
        for t in itertools.chain(module.parameters(), module.buffers()):
            if id(t) not in kept and t.is_floating_point():
                t.data = t.data.to(plan.cast_to)


# -- what initialize checks ---------------------------------------------------------------------------------
def is_sharded(model):
    fsdp = getattr(torch.distributed, "fsdp", None) if torch.distributed.is_available() else None
    cls = getattr(fsdp, "FSDPModule", None)
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def param_groups(models):
    """``(module name, policy, dtype of its trainable sharded params or None, FSDPParamGroup)`` per group."""
    from torch.distributed.fsdp import FSDPModule

    for model in models:
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in module._get_fsdp_state()._fsdp_param_groups:
                dtypes = {fp.sharded_param.dtype for fp in group.fsdp_params if fp.sharded_param.requires_grad}
                yield name or "<root>", group_policy(group), (dtypes.pop() if len(dtypes) == 1 else None), group


def group_policy(group):
    """The MixedPrecisionPolicy of an FSDPParamGroup: torch 2.11-2.14 keep it on the group (``mp_policy``);
    2.15 resolves it per param (``FSDPParam.mp_policy``), one policy per ``fully_shard`` call all the same."""
    policy = getattr(group, "mp_policy", None)
    if policy is None and group.fsdp_params:
        policy = getattr(group.fsdp_params[0], "mp_policy", None)
    if policy is None:
        raise TorchVersionError(f"torch {torch.__version__}: an FSDP2 param group has no mp_policy (on the group "
                                "or its params); amp_patch reads it to check the opt level's policy. Tested: torch "
                                f"{TESTED[0]} to {TESTED[1]}; shard with amp_patch.fully_shard and use "
                                "opt_level='O1', or a "
                                "tested torch")
    return policy


def check_sharded(models, props, master_weights=None):
    """The FSDP2 param groups of the models passed to initialize, each checked against the resolved policy
    (``props.weight_layout == "fsdp2"``: O2/O3 on models sharded with a compatible policy, no model cast and no
    master copy: the sharded params are what the optimizer steps)."""
    sharded = [m for m in models if is_sharded(m)]
    if not sharded:
        return []
    groups = list(param_groups(sharded))
    if props.weight_layout != "fsdp2":
        _check_fp32_sharded(groups, props)
        _refuse_remainder(props, master_weights)
        return [g for *_, g in groups]
    if len(sharded) != len(models):
        raise UsageError(f"initialize(opt_level={props.opt_level!r}) got FSDP2-sharded and unsharded models "
                         "together; one opt level cannot cast some and not others here: shard every model "
                         "(amp_patch.fully_shard) or none")
    _refuse_remainder(props, master_weights)
    (_check_o2 if props.master_weights else _check_o3)(groups, props)
    _check_kept_modules(sharded, props)
    log.info("FSDP2: the sharded %s params are what the optimizer steps (%s), no model cast",
             "fp32" if props.master_weights else str(props.cast_model_type),
             "the fp32 masters" if props.master_weights else "no masters, as O3")
    return [g for *_, g in groups]


def _refuse_remainder(props, master_weights):
    if "remainder" in (master_weights, props.master_weights) or getattr(props, "remainder", False):
        raise ConfigError("master_weights='remainder' on an FSDP2-sharded model is not supported yet: FSDP2 keeps "
                          "the fp32 sharded params as the masters, so there is no half model copy to pair an "
                          "int16 remainder with (see docs/distributed.md, FSDP2 limits). Drop master_weights "
                          "(the sharded fp32 params are already the masters, 1/world of them per rank)")


def _check_fp32_sharded(groups, props):
    for name, _, dtype, _ in groups:
        if dtype in HALF_DTYPES:
            raise UsageError(f"FSDP2 group {name!r} holds {dtype} sharded params, but opt_level={props.opt_level!r} "
                             "expects float32 params; shard the fp32 model, or pass opt_level='O3' when it was "
                             "sharded by amp_patch.fully_shard(model, opt_level='O3')")


def _check_o2(groups, props):
    fix = _FIX.format(level=props.opt_level, half=_name(props.cast_model_type))
    half_groups = 0
    for name, policy, dtype, _ in groups:
        if dtype is None:
            continue
        if dtype is not torch.float32:
            raise UsageError(f"opt_level='O2' on FSDP2: group {name!r} holds {dtype} sharded params; O2 keeps the "
                             f"fp32 sharded params as the master weights. Shard the fp32 model: {fix}")
        compute = policy.param_dtype or dtype
        if compute in HALF_DTYPES:
            _check_half_group(name, policy, compute, props, fix)
            half_groups += 1
    if not half_groups:
        raise UsageError(f"opt_level={props.opt_level!r} on a model sharded by FSDP2 (fully_shard) with no half "
                         "MixedPrecisionPolicy: every group computes in float32, so there is nothing for O2 to do, "
                         f"and O2 cannot cast sharded params itself. Instead {fix}; or use opt_level='O1' (op "
                         "lists, any sharding). See docs/distributed.md, FSDP2.")


def _check_half_group(name, policy, compute, props, fix):
    if compute is not props.cast_model_type:
        raise UsageError(f"FSDP2 group {name!r} computes in {compute} (mp_policy param_dtype), but "
                         f"initialize got half_dtype={props.cast_model_type}; pass half_dtype={_name(compute)} "
                         "or shard with the same half dtype")
    reduce = policy.reduce_dtype or compute
    if props.master_weights and reduce is not torch.float32:
        raise UsageError(f"opt_level='O2' on FSDP2: group {name!r} reduces gradients in {reduce} "
                         f"(mp_policy reduce_dtype={policy.reduce_dtype}), so there are no fp32 master grads; set "
                         f"reduce_dtype=torch.float32 in its MixedPrecisionPolicy: {fix}")


def _check_o3(groups, props):
    fix = f"shard with amp_patch.fully_shard(model, opt_level={props.opt_level!r})"
    half_groups = 0
    for name, policy, dtype, _ in groups:
        if dtype is None:
            continue
        compute = policy.param_dtype or dtype
        if dtype is torch.float32 and compute in HALF_DTYPES:
            raise UsageError(f"opt_level={props.opt_level!r} on FSDP2: group {name!r} holds fp32 sharded params "
                             "computed in half, which is O2's layout (fp32 masters). Pass opt_level='O2' (with "
                             "master_weights left at its default) for it, "
                             "or shard with amp_patch.fully_shard(model, opt_level='O3') for half params without "
                             "masters")
        if dtype in HALF_DTYPES:
            _check_half_group(name, policy, dtype, props, fix)
            half_groups += 1
    if not half_groups:
        raise UsageError(f"opt_level={props.opt_level!r} on a model sharded by FSDP2 with float32 params and no "
                         "half policy; O3 cannot cast sharded params itself. Shard with amp_patch.fully_shard(model, "
                         "opt_level='O3') (half params, half reduction, no masters), or use opt_level='O2' with a "
                         "half MixedPrecisionPolicy (amp_patch.fully_shard(model, opt_level='O2'))")


def _check_kept_modules(models, props):
    """keep_fp32_modules given to initialize must be fp32 groups: initialize cannot regroup a sharded model."""
    from torch.distributed.fsdp import FSDPModule

    for model in models:
        for name, module in model.named_modules():
            if not (props.keep_fp32_modules and isinstance(module, props.keep_fp32_modules) and _has_params(module)):
                continue
            policies = [group_policy(g) for g in module._get_fsdp_state()._fsdp_param_groups] \
                if isinstance(module, FSDPModule) else []
            if not policies or any(p.param_dtype in HALF_DTYPES for p in policies):
                raise UsageError(f"keep_fp32_modules names {type(module).__name__}, but FSDP2 computes module "
                                 f"{name!r} in half (it is {'in a half group' if policies else 'in its parent group'}"
                                 "); initialize cannot regroup a sharded model. Pass keep_fp32_modules to "
                                 f"amp_patch.fully_shard(model, opt_level={props.opt_level!r}, keep_fp32_modules=...) "
                                 "too, or drop it from initialize")


def _name(dtype):
    return str(dtype)
