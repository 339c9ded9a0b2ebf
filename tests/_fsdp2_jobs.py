"""Per-rank jobs of tests/integration/test_fsdp2.py (run by ``_dist_worker.run_ranks("_fsdp2_jobs:main", ...)``).

One plan of 6 optimizer steps runs under DDP O2 and under amp_patch.fully_shard + O2: two losses (two forwards,
loss ids 0 and 1), gradient accumulation (DDP ``no_sync()`` / FSDP2 ``set_requires_gradient_sync(False)``), an inf
injected on rank 1 only, ``clip_grad_norm_`` through ``master_params``. The FSDP2 run also stops at a given step,
checkpoints (DCP + amp_patch.state_dict()), rebuilds everything and resumes.
"""
import contextlib
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import amp_patch

HALF = torch.float16
STEPS = 6
#: per step: (accumulate: micro-batch 0 without gradient sync, loss ids of the two micro-batches, an inf on rank 1
#: in micro-batch 0: "input" in its data, "grad" in one element of rank 1's own reduced grad, so rank 0 sees none).
#: With growth_interval=1 loss 0's scale (backed off at step 2) grows again inside step 5's accumulation unless
#: that micro-batch's scale_loss exit is delayed.
PLAN = [(False, (0, 1), None), (True, (0, 0), None), (False, (0, 1), "input"),
        (True, (1, 1), "input"), (False, (1, 1), "grad"), (True, (0, 0), None)]
SKIPPED = [inject is not None for _, _, inject in PLAN]
INIT = dict(opt_level="O2", half_dtype=HALF, keep_fp32_modules=(torch.nn.LayerNorm,), num_losses=2,
            max_loss_scale=2.0 ** 10, growth_interval=1, verbosity=0)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def batch(rank, step, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    if PLAN[step][2] == "input" and rank == 1 and micro == 0:
        x[0, 0] = float("inf")
    return x, y


def train_step(rank, step, model, opt, no_sync):
    """One optimizer step of PLAN[step]; returns (losses, total grad norm, skipped)."""
    accumulate, loss_ids, inject = PLAN[step]
    losses = []
    for micro, loss_id in enumerate(loss_ids):
        x, y = batch(rank, step, micro)
        with no_sync() if accumulate and micro == 0 else contextlib.nullcontext():
            loss = F.mse_loss(model(x), y)
            with amp_patch.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                scaled.backward()
                if inject == "grad" and rank == 1 and micro == 0:
                    grad = next(model.parameters()).grad  # reduced already: rank 1's copy (DDP) or shard (FSDP2)
                    (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
        losses.append(loss.item())
    norm = torch.nn.utils.clip_grad_norm_(amp_patch.master_params(opt), 5.0)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    opt.step()
    opt.zero_grad()
    return losses, float(norm), amp_patch.last_step_skipped(opt)


def run(rank, model, opt, no_sync, steps):
    out = {"losses": [], "norms": [], "skipped": []}
    for step in steps:
        losses, norm, skipped = train_step(rank, step, model, opt, no_sync)
        out["losses"].append(losses)
        out["skipped"].append(skipped)
        if not skipped:
            out["norms"].append(norm)
    return out


def ddp_o2(rank):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp_patch.initialize(model, opt, **INIT)
    ddp = DDP(model)
    try:
        out = run(rank, ddp, opt, ddp.no_sync, range(STEPS))
        out["params"] = [p.detach().clone() for p in amp_patch.master_params(opt)]
        return out
    finally:
        amp_patch.deinitialize()
        del ddp


@contextlib.contextmanager
def fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def sharded(seed=0, **extra):
    model = make_model(seed)
    amp_patch.fully_shard(model, opt_level="O2", half_dtype=HALF, keep_fp32_modules=(torch.nn.LayerNorm,),
                          wrap=(torch.nn.Linear,), **extra)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return (*amp_patch.initialize(model, opt, diagnose_overflow=True, **INIT), model)


def full_state(model, opt):
    """Full params (unsharded), this rank's optimizer state and the amp state: what a resume must reproduce."""
    return {"params": [p.full_tensor().detach().clone() for p in model.parameters()],
            "opt": {k: v.to_local().clone() if hasattr(v, "to_local") else v
                    for s in opt.state.values() for k, v in s.items()},
            "amp": amp_patch.state_dict()}


def fsdp_o2(rank):
    model, opt, _ = sharded()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = run(rank, model, opt, lambda: fsdp_no_sync(model), range(STEPS))
        out["warnings"] = [str(w.message) for w in caught]
        out.update(full_state(model, opt))
        out["layout"] = layout(model, opt)
        out["history"] = [(r["loss_id"], r["skipped"], r["cause_kind"]) for r in amp_patch.history()]
        out["overflows"] = [{"module": (o["first_bad_module"] or {}).get("module"),
                             "params": [row["param"] for row in o["params"]]}
                            for o in (r["overflow"] for r in amp_patch.history()) if o is not None]
        out["trace"] = _error_of(amp_patch.trace)
        return out
    finally:
        amp_patch.deinitialize()


def layout(model, opt):
    """What O2 on FSDP2 holds: sharded param dtypes, optimizer params are the model's, the compute dtypes."""
    seen = {}

    def record(name):
        def hook(module, args, out):
            seen[name] = (args[0].dtype, out.dtype)
        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in model.named_children()]
    with torch.no_grad():
        out = model(torch.randn(2, 6))
    for h in hooks:
        h.remove()
    return {"sharded_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "opt_params_are_model_params": [id(p) for g in opt.param_groups for p in g["params"]]
            == [id(p) for p in model.parameters()],
            "io": {n: (str(a), str(o)) for n, (a, o) in seen.items()}, "out": str(out.dtype)}


def resume(rank, stop, path):
    """Train to ``stop``, checkpoint, rebuild from another seed, load, train to the end."""
    model, opt, _ = sharded()
    try:
        first = run(rank, model, opt, lambda: fsdp_no_sync(model), range(stop))
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        amp = amp_patch.state_dict()
    finally:
        amp_patch.deinitialize()
    model, opt, _ = sharded(seed=7)
    try:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        amp_patch.load_state_dict(amp)
        second = run(rank, model, opt, lambda: fsdp_no_sync(model), range(stop, STEPS))
        return {"losses": first["losses"] + second["losses"], "skipped": first["skipped"] + second["skipped"],
                **full_state(model, opt)}
    finally:
        amp_patch.deinitialize()


def _error_of(call):
    try:
        with call() if call is amp_patch.trace else contextlib.nullcontext(call()):
            pass
    except amp_patch.AmpPatchError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def o3(rank):
    """amp_patch.fully_shard(opt_level="O3"): half sharded params, half grads, no masters; two steps train."""
    model = make_model()
    amp_patch.fully_shard(model, opt_level="O3", half_dtype=HALF, wrap=torch.nn.Linear)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O3", half_dtype=HALF, verbosity=0)
    try:
        before = [p.full_tensor().clone() for p in model.parameters()]
        losses = []
        for step in (0, 4):
            x, y = batch(rank, step, 0)
            loss = F.mse_loss(model(x), y)
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
            grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        bn = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8))
        amp_patch.fully_shard(bn, opt_level="O3", half_dtype=HALF)
        bn_out = bn(torch.randn(4, 6))
        return {"dtypes": sorted({str(p.dtype) for p in model.parameters()}), "grad_dtypes": grad_dtypes,
                "bn": (str(bn[1].running_mean.dtype), str(bn[1].weight.dtype), bool(torch.isfinite(bn_out).all())),
                "losses": losses, "masters_are_params": [id(p) for p in amp_patch.master_params(opt)]
                == [id(p) for p in model.parameters()],
                "changed": [not torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters())]}
    finally:
        amp_patch.deinitialize()


def groups():
    """The FSDP2 groups amp_patch.fully_shard makes under O2 for a model with a BatchNorm and a LayerNorm."""
    from amp_patch.parallel.fsdp2 import param_groups

    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)), torch.nn.Linear(8, 3))
    amp_patch.fully_shard(model, opt_level="O2", half_dtype=torch.bfloat16, keep_fp32_modules=torch.nn.LayerNorm,
                          wrap=lambda m: isinstance(m, torch.nn.Sequential) and len(m) == 2)
    out = model(torch.randn(4, 6))
    out.float().sum().backward()
    assert out.dtype is torch.float32 and bool(torch.isfinite(out).all())
    o1 = make_model()
    amp_patch.fully_shard(o1, opt_level="O1", wrap=torch.nn.Linear)
    return {name: (str(policy.param_dtype), str(policy.reduce_dtype), str(policy.output_dtype),
                   policy.cast_forward_inputs, str(dtype)) for name, policy, dtype, _ in param_groups([model])}, \
        sorted((name, policy == type(policy)()) for name, policy, _, _ in param_groups([o1]))


def _switch_loss_id_while_unsynced(rank):
    model, opt, _ = sharded()
    try:
        x, y = batch(rank, 0, 0)
        with fsdp_no_sync(model):
            with amp_patch.scale_loss(F.mse_loss(model(x), y), opt, loss_id=0) as scaled:
                scaled.backward()
        return _error_of(lambda: amp_patch.scale_loss(F.mse_loss(model(x), y), opt, loss_id=1).__enter__())
    finally:
        amp_patch.deinitialize()


def refusals(rank):
    """initialize on models sharded by torch's fully_shard with policies O2/O3 cannot use, and misuse."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def shard(policy, half=False):
        model = make_model()
        if half:
            model.half()
        for module in (model[0], model):
            fully_shard(module, mp_policy=policy)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def init(model_opt, **kwargs):
        try:
            return _error_of(lambda: amp_patch.initialize(*model_opt, verbosity=0, **kwargs))
        finally:
            amp_patch.deinitialize()

    fp16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # (remainder: bf16 only)
    out = {"none O2": init(shard(MixedPrecisionPolicy()), opt_level="O2"),
           "none O3": init(shard(MixedPrecisionPolicy()), opt_level="O3"),
           "half reduce O2": init(shard(MixedPrecisionPolicy(param_dtype=torch.float16)), opt_level="O2"),
           "bf16 policy, fp16 init": init(shard(fp16), opt_level="O2", half_dtype=torch.bfloat16),
           "O2 layout O3": init(shard(fp16), opt_level="O3"),
           "remainder": init(shard(bf16), opt_level="O2", half_dtype=torch.bfloat16, master_weights="remainder"),
           "half params O1": init(shard(MixedPrecisionPolicy(), half=True), opt_level="O1"),
           "user policy O2": init(shard(fp16), opt_level="O2")}
    model, _ = shard(fp16)
    out["already sharded"] = _error_of(lambda: amp_patch.fully_shard(model))
    unkept = make_model()
    amp_patch.fully_shard(unkept, opt_level="O2", half_dtype=HALF, wrap=torch.nn.Linear)
    out["keep not sharded"] = init((unkept, torch.optim.SGD(unkept.parameters(), lr=0.1)),
                                   **{k: v for k, v in INIT.items() if k != "verbosity"})
    out["loss id switch in accumulation"] = _switch_loss_id_while_unsynced(rank)
    mixed = torch.nn.ModuleList([shard(fp16)[0], make_model()])
    out["mixed"] = init((list(mixed), torch.optim.SGD(mixed.parameters(), lr=0.1)), opt_level="O2")
    return out


def _guarded(job, *args):
    """A scenario's result, or {"error": its traceback}: one broken scenario fails its own tests only (every
    rank raises alike, so no rank is left waiting in a collective)."""
    try:
        return job(*args)
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        import traceback
        return {"error": traceback.format_exc()}


def main(rank, world, stop, path):
    return {"ddp": _guarded(ddp_o2, rank), "fsdp": _guarded(fsdp_o2, rank),
            "resume": _guarded(resume, rank, stop, path), "o3": _guarded(o3, rank), "groups": _guarded(groups),
            "refusals": _guarded(refusals, rank)}


def four(rank, world):
    """The DDP / FSDP2 comparison alone (the opt-in 4-rank test)."""
    return {"ddp": ddp_o2(rank), "fsdp": fsdp_o2(rank)}
