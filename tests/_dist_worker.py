"""Multi-process helpers for tests/integration/test_distributed.py: a launcher with a deadline, and the per-rank jobs.

``run_ranks(job, tmp_path, ...)`` starts ``world`` fresh interpreters
(``python -c "import _dist_worker; _dist_worker._entry(rank, dir)"``; no
multiprocessing, so it works however pytest was started), each of which joins a
gloo process group through a FileStore in ``tmp_path``, runs
``JOBS[job](rank, world, **kwargs)`` and saves the returned object with
``torch.save``. As soon as one rank exits non-zero the parent kills the others
(they may be blocked in a collective) and raises AssertionError with every
rank's output; at the deadline it kills them all, so a hang fails the test.
Every rank calls ``amp_patch.deinitialize()`` and ``destroy_process_group()``
in ``finally`` blocks; files live in pytest's ``tmp_path``.
"""
import datetime
import gc
import logging
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import amp_patch
import amp_patch.distributed as amp_dist
from amp_patch._torch import dist as torch_dist

HALF = torch.float16
#: ddp_levels and its single-process twin start at this scale: under DDP each rank backpropagates the full loss
#: (DDP divides by the world size after backward), k times the scaled grads of accumulation with loss / k, so
#: 2**16 overflows the fp16 grads on the DDP side only and the two would skip different steps.
EQUIV_MAX_SCALE = 2.0 ** 10


# -- launcher ---------------------------------------------------------------------------------------
def run_ranks(job, tmp_path, world=2, timeout=45.0, scale=True, **kwargs):
    """Run ``JOBS[job]`` (or ``"module:function"``) on ``world`` gloo ranks in fresh interpreters; return the
    per-rank results. ``timeout``: an idle machine's figure, scaled to the measured speed
    (``tests_support.time_limit``) unless ``scale`` is False."""
    from tests_support import time_limit
    timeout = round(time_limit(timeout)) if scale else timeout
    out = str(tmp_path)
    torch.save({"job": job, "world": world, "kwargs": kwargs}, os.path.join(out, "job.pt"))
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    procs = []
    deadline = time.monotonic() + timeout
    try:
        for r in range(world):
            code = f"import _dist_worker as w; w._entry({r}, {out!r})"
            with open(os.path.join(out, f"rank{r}.log"), "w") as log_file:
                procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log_file,
                                              stderr=subprocess.STDOUT))
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break  # a rank failed: the others may wait forever in a collective
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0] * world:
        logs = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.log")) as f:
                logs.append(f"--- rank {r} (exit code {codes[r]}) ---\n{f.read()[-4000:]}")
        what = "timed out after %s s" % timeout if time.monotonic() > deadline else "a rank failed"
        raise AssertionError(f"{job}: {what}\n" + "\n".join(logs))
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _entry(rank, out):
    torch.set_num_threads(1)  # two ranks on two cores
    spec = torch.load(os.path.join(out, "job.pt"), weights_only=False)
    world = spec["world"]
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out, "filestore"), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        result = _job(spec["job"])(rank, world, **spec["kwargs"])
        dist.barrier()  # nobody tears the group down while a peer is still in a collective
    finally:
        amp_patch.deinitialize()
        gc.collect()  # DDP modules (reference cycles) must go before their process group: else abort at exit
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def _job(name):
    """A job of this module, or ``"module:function"`` from another test helper module."""
    if ":" not in name:
        return JOBS[name]
    import importlib

    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


# -- shared pieces ----------------------------------------------------------------------------------
def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def dataset(n=16):
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g))


def loss_of(model, x, y):
    return F.mse_loss(model(x).float(), y)


def snapshot(model, opt):
    """Everything that must agree across ranks (or with a reference), as CPU tensors / plain values."""
    return {"params": [p.detach().clone() for p in model.parameters()],
            "masters": [p.detach().float().clone() for p in amp_patch.master_params(opt)],
            "opt": opt.state_dict(),
            "amp": amp_patch.state_dict()}


# -- jobs -------------------------------------------------------------------------------------------
def _step_consistency(rank, ddp, opt, batches, plan, inject_rank=1):
    """One optimizer step over micro-batches; ``plan`` is a list of (no_sync, delay_unscale, inject)."""
    for (x, y), (no_sync, delay, inject) in zip(batches, plan):
        if inject == "input" and rank == inject_rank:
            x = x.clone()
            x[0, 0] = float("inf")
        ctx = ddp.no_sync() if no_sync else _Null()
        with ctx:
            loss = loss_of(ddp, x, y)
            if inject == "loss" and rank == inject_rank:
                loss = loss * float("nan")
            with amp_patch.scale_loss(loss, opt, delay_unscale=delay) as scaled:
                scaled.backward()
    opt.step()
    opt.zero_grad()
    return amp_patch.last_step_skipped(opt), amp_patch.loss_scale()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


#: (name, plan) per iteration; plan entries are (inside no_sync, delay_unscale, inject on rank 1)
CONSISTENCY_PLAN = [
    ("clean", [(False, False, None)]),
    ("inf input, synced", [(False, False, "input")]),
    ("NaN loss inside no_sync, delayed unscale", [(True, True, "loss"), (False, False, None)]),
    ("clean no_sync accumulation k=3", [(True, True, None), (True, True, None), (False, False, None)]),
    ("inf input, every micro-batch delayed (step finishes the unscale)", [(False, True, None), (False, True, "input")]),
    ("clean", [(False, False, None)]),
    ("inf input, unscaled inside no_sync (O2: deferred while no_sync is open)",
     [(True, False, "input"), (False, False, None)]),
    ("clean no_sync accumulation k=2", [(True, True, None), (False, False, None)]),
    ("clean", [(False, False, None)]),
]


def _consistency_run(rank, level):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=HALF, verbosity=0, growth_interval=3)
    try:
        ddp = DDP(model)
        g = torch.Generator().manual_seed(100 + rank)  # every rank its own data
        history = []
        for _, plan in CONSISTENCY_PLAN:
            batches = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in plan]
            history.append(_step_consistency(rank, ddp, opt, batches, plan))
        return {"history": history, **snapshot(model, opt)}
    finally:
        amp_patch.deinitialize()


def consistency(rank, world, levels=("O1", "O2"), control_levels=("O1", "O2")):
    """Train through CONSISTENCY_PLAN under DDP per level; then again with the overflow flag *not* agreed
    across ranks (control: shows which iteration depends on agree_overflow)."""
    results = {level: _consistency_run(rank, level) for level in levels}
    agree = torch_dist.agree_overflow
    torch_dist.agree_overflow = lambda found_inf, device=None: found_inf
    try:
        results["control"] = {level: _consistency_run(rank, level) for level in control_levels}
    finally:
        torch_dist.agree_overflow = agree
    return results


def ddp_levels(rank, world, levels=("O0", "O1", "O2", "O3"), steps=3, batch=2, lr=0.1):
    """DDP after initialize at each level, one micro-batch per rank per step from a DistributedSampler."""
    results = {"ddp_first": None}
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    try:
        amp_patch.initialize(DDP(model), opt, opt_level="O1", verbosity=0)
    except amp_patch.UsageError as exc:
        results["ddp_first"] = str(exc)
    finally:
        amp_patch.deinitialize()
    for level in levels:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=HALF, verbosity=0,
                                          max_loss_scale=EQUIV_MAX_SCALE)
        try:
            ddp = DDP(model)
            sampler = DistributedSampler(dataset(), num_replicas=world, rank=rank, shuffle=True, seed=0)
            loader = DataLoader(dataset(), batch_size=batch, sampler=sampler)
            grads_seen = []
            for _step, (x, y) in zip(range(steps), loader):
                with amp_patch.scale_loss(loss_of(ddp, x, y), opt) as scaled:
                    scaled.backward()
                    grads_seen.append([p.grad.detach().clone() for p in model.parameters()])
                opt.step()
                opt.zero_grad()
            results[level] = {"grads": grads_seen, "skipped": amp_patch.last_step_skipped(opt),
                              **snapshot(model, opt)}
        finally:
            amp_patch.deinitialize()
    return results


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def logging_job(rank, world):
    """Configuration and overflow lines with the default rank-0 filter and with log_all_ranks=True."""
    logger = logging.getLogger("amp_patch")
    logger.setLevel(logging.INFO)
    handler = _Collect()
    logger.addHandler(handler)
    out = {}
    try:
        for all_ranks in (False, True):
            handler.messages = []
            model = make_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=HALF, log_all_ranks=all_ranks)
            try:
                ddp = DDP(model)
                x, y = torch.randn(2, 6), torch.randn(2, 3)
                if rank == 1:
                    x[0, 0] = float("inf")
                with amp_patch.scale_loss(loss_of(ddp, x, y), opt) as scaled:
                    scaled.backward()
                opt.step()
                out[all_ranks] = {"messages": list(handler.messages), "skipped": amp_patch.last_step_skipped(opt)}
            finally:
                amp_patch.deinitialize()
        handler.messages = []
        logger.info("after deinitialize")  # the filter left with the session
        out["after"] = list(handler.messages)
    finally:
        logger.removeHandler(handler)
    return out


def master_sync(rank, world):
    """O2 with a different seed per rank: DDP syncs the half params only; broadcast_master_params fixes it."""
    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=HALF, verbosity=0)
    try:
        ddp = DDP(model)
        out = {"stale": amp_dist.masters_out_of_sync(),
               "masters_before": [p.detach().clone() for p in amp_patch.master_params(opt)]}
        amp_dist.broadcast_master_params()
        out["after"] = amp_dist.masters_out_of_sync()
        x, y = torch.randn(2, 6), torch.randn(2, 3)
        with amp_patch.scale_loss(loss_of(ddp, x, y), opt) as scaled:
            scaled.backward()
        opt.step()
        out.update(snapshot(model, opt))
        return out
    finally:
        amp_patch.deinitialize()


def master_warning(rank, world):
    """Half params overwritten with rank 0's by hand (DDP's own broadcast is followed by the masters): the first
    scale_loss warns on the rank whose masters are stale. (The two-copy layout of the apex alias: default O2 has
    no second copy to go stale.)"""
    import warnings

    from amp_patch.legacy.stacking import open_apex_session

    model = make_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = open_apex_session(model, opt, dict(opt_level="O2", half_dtype=HALF, verbosity=0))
    try:
        ddp = DDP(model)
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p.data, src=0)
                p.add_(rank)  # (rank 0 keeps its masters' values; rank 1 drifts from its masters)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                with amp_patch.scale_loss(loss_of(ddp, torch.randn(2, 6), torch.randn(2, 3)), opt) as scaled:
                    scaled.backward()
        return [str(w.message) for w in caught if "master weights" in str(w.message)]
    finally:
        amp_patch.deinitialize()


def no_sync_check(rank, world):
    """amp_patch.parallel.ddp.check_unscale_inside_no_sync on a real DDP module, in and out of no_sync()."""
    ddp = DDP(make_model())
    out = {"synced": amp_dist.check_unscale_inside_no_sync(ddp, False)}
    with ddp.no_sync():
        out["delayed"] = amp_dist.check_unscale_inside_no_sync(ddp, True)
        try:
            amp_dist.check_unscale_inside_no_sync(ddp, False)
            out["not_delayed"] = None
        except amp_patch.UsageError as exc:
            out["not_delayed"] = str(exc)
    return out


def misc(rank, world):
    """Several short checks in one launch (each process start costs seconds on 2 cores)."""
    return {"levels": ddp_levels(rank, world), "logging": logging_job(rank, world),
            "master_sync": master_sync(rank, world), "no_sync_check": no_sync_check(rank, world),
            "master_warning": master_warning(rank, world)}


def _accumulate(rank, level, use_no_sync, steps=4, k=3, inject_step=1, num_losses=1):
    """k micro-batches per step, the first k-1 inside no_sync() (or all synced), scale_loss called as legacy
    loops do (no delay_unscale, no model=); an inf on rank 1 inside the first no_sync micro-batch of one step.
    With num_losses=2 the micro-batches alternate loss ids (0, 1, 0): two scalers meet inside one no_sync()."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=HALF, verbosity=0,
                                      num_losses=num_losses)
    try:
        ddp = DDP(model)
        g = torch.Generator().manual_seed(300 + rank)
        skipped = []
        for step in range(steps):
            for micro in range(k):
                x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
                if step == inject_step and micro == 0 and rank == 1:
                    x[0, 0] = float("inf")
                with ddp.no_sync() if use_no_sync and micro < k - 1 else _Null():
                    with amp_patch.scale_loss(loss_of(ddp, x, y) / k, opt, loss_id=micro % num_losses) as scaled:
                        scaled.backward()
            opt.step()
            opt.zero_grad()
            skipped.append(amp_patch.last_step_skipped(opt))
        return {"skipped": skipped, **snapshot(model, opt)}
    finally:
        amp_patch.deinitialize()


def no_sync_accumulation(rank, world):
    runs = {level: {"no_sync": _accumulate(rank, level, True), "synced": _accumulate(rank, level, False)}
            for level in ("O1", "O2")}
    runs["O2 two losses"] = {"no_sync": _accumulate(rank, "O2", True, num_losses=2),
                             "synced": _accumulate(rank, "O2", False, num_losses=2)}
    return runs


def _fsdp_train(rank, level=None, half=torch.bfloat16, policy=None, steps=4, inject_step=None, **init):
    """FSDP2 on each Linear and the root (sharding first), then initialize (unless level is None); losses and
    the full (unsharded) parameters."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for module in (model[0], model[2], model):
        fully_shard(module, **({"mp_policy": policy} if policy is not None else {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if level is not None:
        model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0, **init)
    try:
        g = torch.Generator().manual_seed(500 + rank)
        losses, skipped = [], []
        for step in range(steps):
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            if step == inject_step and rank == 1:
                x[0, 0] = float("inf")
            out = model(x)
            loss = F.mse_loss(out.float(), y)
            if level is None:
                loss.backward()
            else:
                with amp_patch.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            skipped.append(level is not None and amp_patch.last_step_skipped(opt))
        return {"losses": losses, "skipped": skipped, "out_dtype": out.dtype,
                "params": [p.full_tensor().detach().clone() for p in model.parameters()]}
    finally:
        amp_patch.deinitialize()


def _fsdp_refusals():
    from torch.distributed.fsdp import fully_shard

    out = {}
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", verbosity=0)
    try:  # the wrong order: initialize, then shard
        fully_shard(model)
        with amp_patch.scale_loss(loss_of(model, torch.randn(2, 6), torch.randn(2, 3)), opt) as scaled:
            scaled.backward()
        out["sharded_after"] = None
    except amp_patch.UsageError as exc:
        out["sharded_after"] = str(exc)
    finally:
        amp_patch.deinitialize()
    for level in ("O2", "O3"):
        model = make_model()
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
            out[level] = None
        except amp_patch.UsageError as exc:
            out[level] = str(exc)
        finally:
            amp_patch.deinitialize()
    return out


def fsdp2(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return {"fp32": _fsdp_train(rank), "O1 bf16": _fsdp_train(rank, "O1"),
            "O1 fp16": _fsdp_train(rank, "O1", half=torch.float16),
            "O1 fp16 inf": _fsdp_train(rank, "O1", half=torch.float16, inject_step=1),
            "O0 policy fp16 inf": _fsdp_train(rank, "O0", policy=policy, inject_step=1, loss_scale="dynamic"),
            "refusals": _fsdp_refusals()}


def models_job(rank, world):
    """One launch for the no_sync accumulation runs and the FSDP2 runs."""
    return {"no_sync": no_sync_accumulation(rank, world), "fsdp2": fsdp2(rank, world)}


def fail_on_rank_1(rank, world):
    """Rank 1 raises while rank 0 waits in a collective: the launcher must kill rank 0 and report rank 1."""
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()


def hang(rank, world):
    time.sleep(600)


JOBS = {"consistency": consistency, "misc": misc, "models": models_job, "fail_on_rank_1": fail_on_rank_1, "hang": hang}
