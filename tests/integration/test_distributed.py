"""amp_patch under torch.distributed (gloo, 2 processes) and under concurrent threads.

The multi-process checks run in a few launches (module-scoped fixtures; a process
start costs seconds on 2 cores) through ``_dist_worker.run_ranks``: fresh
interpreters, a FileStore in tmp_path, a deadline after which every rank is
killed, and a rank failure that kills its peers at once. The example script runs
under ``python -m torch.distributed.run --standalone`` (free port) with a timeout
that kills its whole process group.
"""
import os
import sys
import threading

import _dist_worker as w
import pytest
import torch
from tests_support import REPO, run_killing_group
from torch.utils.data import DataLoader, DistributedSampler

import amp_patch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

ROOT = str(REPO)
EXAMPLE = os.path.join(ROOT, "examples", "ddp_train.py")


def assert_same(a, b, path="state"):
    """Bitwise equality of nested dicts/lists/tensors (dtype included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# -- rank consistency with a one-rank overflow ----------------------------------------------------------
@pytest.fixture(scope="module")
def consistency(tmp_path_factory):
    return w.run_ranks("consistency", tmp_path_factory.mktemp("consistency"), timeout=50)


SKIPPED = [bool(plan and any(inject for _, _, inject in plan)) for _, plan in w.CONSISTENCY_PLAN]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_one_rank_overflow_skips_the_same_steps_on_every_rank(consistency, level):
    """inf/NaN injected on rank 1 only (input or loss; synced, inside no_sync, delayed unscale): both ranks
    skip exactly the injected iterations and back off to the same scale."""
    rank0, rank1 = (r[level]["history"] for r in consistency)
    assert rank0 == rank1
    assert [skipped for skipped, _ in rank0] == SKIPPED
    scales = [2.0 ** 16] + [scale for _, scale in rank0]
    for i, (skipped, scale) in enumerate(rank0):
        if skipped:
            assert scale <= scales[i] / 2, (i, w.CONSISTENCY_PLAN[i][0])


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ranks_end_bitwise_identical(consistency, level):
    """Parameters, fp32 masters, Adam state (moments and step counts) and loss scaler state."""
    rank0, rank1 = (r[level] for r in consistency)
    for key in ("params", "masters", "opt", "amp"):
        assert_same(rank0[key], rank1[key], key)
    assert all(p.dtype is torch.float32 for p in rank0["params"])  # (O2: the fp32 params are the masters)
    assert all(p.dtype is torch.float32 for p in rank0["masters"])
    assert rank0["amp"]["loss_scaler0"]["skipped_steps"] == sum(SKIPPED)


def test_unscale_inside_no_sync_keeps_grads_for_ddp_at_every_level(consistency):
    """Control runs with the flag *not* agreed. A micro-batch "unscaled" inside no_sync keeps its grads in
    param.grad (O1: unscaled in place; O2: the exit is deferred while no_sync is open, so they never reach the
    fp32 master grads unreduced), hence the synced backward's all-reduce carries rank 1's inf to rank 0 and both
    ranks skip even without agree_overflow. (Before no_sync was tracked, O2 moved them into the masters, the
    overflow stayed local to rank 1 and the replicas parted ways there.)"""
    local = next(i for i, (name, _) in enumerate(w.CONSISTENCY_PLAN) if "unscaled inside no_sync" in name)
    for level in ("O1", "O2"):
        rank0, rank1 = (r["control"][level]["history"] for r in consistency)
        assert rank0 == rank1 and rank0[local][0] is True, level


# -- DDP at every opt level, accumulation == DDP, logging, master sync --------------------------------
@pytest.fixture(scope="module")
def misc(tmp_path_factory):
    return w.run_ranks("misc", tmp_path_factory.mktemp("misc"), timeout=50)


def test_ddp_before_initialize_raises(misc):
    for rank in misc:
        message = rank["levels"]["ddp_first"]
        assert message is not None and "initialize() on the bare model first" in message


@pytest.mark.parametrize("level,grad_dtype", [("O0", torch.float32), ("O1", torch.float32), ("O2", torch.float32),
                                              ("O3", torch.float16)])  # (O2: fp32 params; half traffic: comm hooks)
def test_ddp_after_initialize_reduces_grads_of_the_model_dtype(misc, level, grad_dtype):
    """The grads DDP all-reduced (read inside scale_loss, before the unscale) have the model params' dtype and
    are identical on both ranks, although each rank saw different samples; the results match bitwise."""
    rank0, rank1 = (r["levels"][level] for r in misc)
    for step0, step1 in zip(rank0["grads"], rank1["grads"]):
        assert all(g.dtype is grad_dtype for g in step0)
        assert_same(step0, step1, "grads")
    for key in ("params", "masters", "opt", "amp"):
        assert_same(rank0[key], rank1[key], key)
    if level == "O2":
        assert all(p.dtype is torch.float32 for p in rank0["masters"])


def single_process_accumulation(level, steps=3, batch=2, world=2, lr=0.1):
    """What ddp_levels does on ``world`` ranks, done by one process: rank r's micro-batch, loss / world."""
    model = w.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=w.HALF, verbosity=0,
                                      max_loss_scale=w.EQUIV_MAX_SCALE)
    try:
        loaders = [iter(DataLoader(w.dataset(), batch_size=batch,
                                   sampler=DistributedSampler(w.dataset(), num_replicas=world, rank=r, seed=0)))
                   for r in range(world)]
        for _ in range(steps):
            for loader in loaders:
                x, y = next(loader)
                with amp_patch.scale_loss(w.loss_of(model, x, y) / world, opt) as scaled:
                    scaled.backward()
            opt.step()
            opt.zero_grad()
        return w.snapshot(model, opt)
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("level,tol", [("O0", 1e-6), ("O1", 1e-4), ("O2", 2e-3)])
def test_accumulation_equals_ddp(misc, level, tol):
    """k=2 micro-batches accumulated on one process with loss/k == 2 ranks with one micro-batch each under DDP
    with DistributedSampler (3 SGD+momentum steps, lr 0.1, params of size ~0.3). Both sides start at loss scale
    2**10 (w.EQUIV_MAX_SCALE) so that neither skips a step: DDP ranks backpropagate the undivided loss, twice the
    scaled grads of the loss/2 side, and 2**16 overflows fp16 there only. (Observed on CPU: O0 and O1 equal
    bitwise, O2 1.0e-4.)

    O0: fp32 throughout; only the summation order differs ((g0 + g1) / 2 vs g0/2 + g1/2): 1e-6.
    O1: the forward/backward of each micro-batch is the same computation on both sides (same half casts of the
    same fp32 weights; loss/2 only scales the grads by an exact power of two), and DDP reduces fp32 grads, so
    again only fp32 summation order differs; 1e-4 leaves room for a weight whose half cast rounds the other way
    after a 1-ulp fp32 difference (one half ulp at |w|~0.3 is 2.4e-4 in the forward, damped by lr 0.1).
    O2: DDP sums the two half grads *in fp16* (one extra rounding, relative 2**-11 = 4.9e-4 of a grad) where the
    reference adds them in the fp32 master grads; the half model weights copied from the masters can then differ
    by one half ulp (2**-11 relative, 2.4e-4 at 0.3) and feed that into the next forward. Per step the masters move
    by lr * |grad| <= 0.1, so three steps with momentum give at most ~3 * (2 * 4.9e-4 * 0.1 + 2.4e-4 * 0.5) ~ 7e-4;
    2e-3 is that bound with margin, and still ~100x below the size of one step's update.
    """
    ddp = misc[0]["levels"][level]
    ref = single_process_accumulation(level)
    assert ddp["amp"]["loss_scaler0"]["skipped_steps"] == ref["amp"]["loss_scaler0"]["skipped_steps"] == 0
    for a, b in zip(ddp["masters"], ref["masters"]):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)
    for a, b in zip(ddp["params"], ref["params"]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=0)
    start = [p.detach() for p in w.make_model().parameters()]
    moved = max((a - b).abs().max().item() for a, b in zip(ref["masters"], start))
    assert moved > 20 * tol  # the tolerance is far below what training changed


def test_log_lines_come_from_rank_zero_only(misc):
    """Configuration and overflow lines: rank 0 only by default, every rank with log_all_ranks=True; the
    filter leaves with deinitialize."""
    rank0, rank1 = (r["logging"] for r in misc)
    assert rank0[False]["skipped"] and rank1[False]["skipped"]  # the overflow on rank 1 skipped both
    assert any(m.startswith("opt_level O1") for m in rank0[False]["messages"])
    assert any(m.startswith("Gradient overflow") for m in rank0[False]["messages"])
    assert rank1[False]["messages"] == []
    assert rank1[True]["messages"] == rank0[True]["messages"] == rank0[False]["messages"]
    assert rank0["after"] == rank1["after"] == ["after deinitialize"]


def test_o2_masters_follow_ddp_at_its_construction(misc):
    """Different seeds per rank: DDP broadcasts rank 0's half params, as Apex's
    masters (made after that broadcast) did, the fp32 masters follow at once; broadcast_master_params() is then a
    harmless no-op."""
    rank0, rank1 = (r["master_sync"] for r in misc)
    assert rank0["stale"] == rank1["stale"] == []
    assert all(torch.equal(a, b) for a, b in zip(rank0["masters_before"], rank1["masters_before"], strict=True))
    assert rank0["after"] == rank1["after"] == []
    for key in ("params", "masters", "opt", "amp"):
        assert_same(rank0[key], rank1[key], key)


def test_stale_masters_are_warned_once_on_the_first_scale_loss(misc):
    """Half params overwritten behind amp_patch's back (here: broadcast by hand, not by DDP) are still warned."""
    rank0, rank1 = (r["master_warning"] for r in misc)
    assert rank0 == [] and len(rank1) == 1 and "broadcast_master_params()" in rank1[0]


def test_unscaling_inside_no_sync_is_refused_when_the_model_is_known(misc):
    """The check for scale_loss(model=ddp_model): inside no_sync() only delay_unscale=True keeps ranks equal."""
    for rank in misc:
        check = rank["no_sync_check"]
        assert check["synced"] is None and check["delayed"] is None
        assert "delay_unscale=True" in check["not_delayed"]


# -- the launcher's failure paths -----------------------------------------------------------------------
# -- O2 accumulation inside no_sync() as legacy loops write it (no delay_unscale, no model=) --------------------
@pytest.fixture(scope="module")
def models_runs(tmp_path_factory):
    return w.run_ranks("models", tmp_path_factory.mktemp("models"), timeout=90)


@pytest.fixture(scope="module")
def no_sync_runs(models_runs):
    return [r["no_sync"] for r in models_runs]


@pytest.mark.parametrize("level,tol", [("O1", 1e-4), ("O2", 2e-3), ("O2 two losses", 2e-3)])
def test_no_sync_accumulation_without_delay_unscale(no_sync_runs, level, tol):
    """Ranks end bitwise identical, the step with rank 1's inf (inside no_sync) is skipped on both, and the
    result equals accumulation with every micro-batch synced (O2: DDP sums half grads once instead of per
    micro-batch, one more fp16 rounding). "two losses": loss ids 0 and 1 alternate inside one no_sync(), so the
    grads change scalers while they must stay in param.grad for the synced backward."""
    rank0, rank1 = (r[level] for r in no_sync_runs)
    for key in ("params", "masters", "opt", "amp"):
        assert_same(rank0["no_sync"][key], rank1["no_sync"][key], key)
    assert rank0["no_sync"]["skipped"] == rank0["synced"]["skipped"] == [False, True, False, False]
    for a, b in zip(rank0["no_sync"]["masters"], rank0["synced"]["masters"]):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)


# -- FSDP2 (fully_shard), 2 gloo ranks on CPU ---------------------------------------------------------------
@pytest.fixture(scope="module")
def fsdp(models_runs):
    return [r["fsdp2"] for r in models_runs]


@pytest.mark.parametrize("variant,tol", [("O1 bf16", 3e-2), ("O1 fp16", 5e-3)])
def test_fsdp2_o1_after_sharding_follows_fp32(fsdp, variant, tol):
    """O1 with initialize after fully_shard: half activations, losses and full params near the fp32 run."""
    half = torch.bfloat16 if "bf16" in variant else torch.float16
    for rank in fsdp:
        run, ref = rank[variant], rank["fp32"]
        assert run["out_dtype"] is half and not any(run["skipped"])
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=tol, atol=tol)
        for a, b in zip(run["params"], ref["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=tol)
    assert_same(fsdp[0][variant]["params"], fsdp[1][variant]["params"])


@pytest.mark.parametrize("variant", ["O1 fp16 inf", "O0 policy fp16 inf"])
def test_fsdp2_one_rank_inf_skips_on_both(fsdp, variant):
    """Each rank checks only its own shard of the grads; agree_overflow makes both skip the step. O0 + FSDP2's
    MixedPrecisionPolicy(param_dtype=fp16) + loss_scale="dynamic" still works (O2 on FSDP2:
    tests/integration/test_fsdp2.py)."""
    for rank in fsdp:
        assert rank[variant]["skipped"] == [False, True, False, False]
    assert_same(fsdp[0][variant]["params"], fsdp[1][variant]["params"])
    for a, b in zip(fsdp[0]["O0 policy fp16 inf"]["params"], fsdp[0]["fp32"]["params"]):
        assert torch.isfinite(a).all() and a.dtype is b.dtype is torch.float32


def test_fsdp2_wrong_order_and_model_casting_are_refused_with_the_fix(fsdp):
    refusals = fsdp[0]["refusals"]
    assert "fully_shard() was applied to the model after amp_patch.initialize()" in refusals["sharded_after"]
    assert "Shard first" in refusals["sharded_after"]
    for level in ("O2", "O3"):  # plain fully_shard (no half policy): the fix is amp_patch.fully_shard or a policy
        assert "MixedPrecisionPolicy" in refusals[level], level
        assert f"amp_patch.fully_shard(model, opt_level='{level}'" in refusals[level], level


def test_a_failing_rank_fails_fast_with_its_traceback(tmp_path):
    """Rank 0 is left blocked in a barrier (gloo timeout 30 s); the launcher kills it at once. (The deadline
    only bounds a broken launcher: two ranks importing a CUDA build of torch on a loaded 2-core box took over
    25 s to start; "a rank failed" below is what proves the launcher did not wait for it.)"""
    with pytest.raises(AssertionError, match="rank 1 fails on purpose") as info:
        w.run_ranks("fail_on_rank_1", tmp_path, timeout=180)
    assert "a rank failed" in str(info.value)


def test_a_hung_rank_fails_at_the_deadline(tmp_path):
    with pytest.raises(AssertionError, match="timed out after 6"):
        w.run_ranks("hang", tmp_path, timeout=6, scale=False)  # the deadline itself is under test


# -- the example under torchrun -------------------------------------------------------------------------
def torchrun(tmp_path, *args, timeout=60):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", EXAMPLE, *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = run_killing_group(cmd, tmp_path, env, timeout=timeout)  # a timeout kills the workers too
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


def test_example_trains_checkpoints_and_resumes_under_torchrun(tmp_path):
    common = ["--opt-level", "O2", "--accum", "2", "--batch-size", "4", "--samples", "64", "--save-every", "2"]
    first = torchrun(tmp_path, *common, "--steps", "4", "--ckpt-dir", "a")
    assert "step 4: loss" in first and "ranks in sync: True" in first
    assert first.count("amp_patch: opt_level O2") == 1  # rank 0 only
    resumed = torchrun(tmp_path, *common, "--steps", "6", "--ckpt-dir", "a", "--resume")
    assert "resumed from step 4" in resumed and "step 6: loss" in resumed and "step 2:" not in resumed
    straight = torchrun(tmp_path, *common, "--steps", "6", "--ckpt-dir", "b")
    a, b = (torch.load(tmp_path / d / "last.pt", weights_only=False) for d in ("a", "b"))
    assert a["step"] == b["step"] == 6
    assert_same(a["model"], b["model"], "model")
    assert_same(a["optimizer"], b["optimizer"], "optimizer")
    assert_same(a["amp"], b["amp"], "amp")
    checksum = [line for line in straight.splitlines() if line.startswith("ranks in sync")]
    assert checksum and checksum[0] in resumed


# -- threads (the nn.DataParallel situation) ---------------------------------------------------------
def test_threads_run_forward_and_backward_of_one_o1_model_at_once():
    """Four threads run forward + backward of the same O1 model concurrently (as nn.DataParallel's per-device
    threads do; here on CPU with one shared module): outputs and grads equal the single-thread ones bitwise,
    and backward() from all threads into the shared .grad sums them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    model = amp_patch.initialize(model, opt_level="O1", half_dtype=w.HALF, verbosity=0)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(3, 8, generator=g) for _ in range(8)]

    def fwd_bwd(x):
        out = model(x)
        return out.detach(), torch.autograd.grad(out.float().pow(2).sum(), params)

    reference = [fwd_bwd(x) for x in inputs]
    amp_patch.clear_cache()
    n_threads, errors = 4, []
    barrier = threading.Barrier(n_threads)

    def run_threads(work):
        def guarded(k):
            try:
                barrier.wait(10)
                work(k)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        threads = [threading.Thread(target=guarded, args=(k,)) for k in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a thread hung"
        assert not errors, errors

    for round_ in range(5):
        results = {}

        def work(k):
            for i in range(k, len(inputs), n_threads):
                results[i] = fwd_bwd(inputs[i])  # noqa: B023 - called within the iteration
        run_threads(work)
        for i, (out, grads) in enumerate(reference):
            assert results[i][0].dtype is w.HALF and torch.equal(results[i][0], out), (round_, i)
            for a, b in zip(results[i][1], grads):
                assert torch.equal(a, b), (round_, i)
        amp_patch.clear_cache()

    def accumulate(k):
        for i in range(k, len(inputs), n_threads):
            model(inputs[i]).float().pow(2).sum().backward()
    run_threads(accumulate)
    for p, *per_input in zip(params, *(grads for _, grads in reference)):
        torch.testing.assert_close(p.grad, torch.stack(per_input).sum(0), rtol=1e-5, atol=1e-6)
