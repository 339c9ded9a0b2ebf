"""amp_patch.fully_shard and O2/O3 on FSDP2: one launch of 2 gloo ranks (tests/_fsdp2_jobs.py) for every
distributed scenario; argument errors in-process (they are raised before any process group is needed).

Tolerances against DDP O2 (same model, data, seeds; docs/distributed.md): DDP all-reduces the half model grads
in fp16, FSDP2 reduce-scatters them in fp32, so they differ by fp16 roundings of the summed grads: losses within
1e-4 (observed 8e-6), grad norms within rtol 1e-3 (observed 1e-4), final params within 1e-4 (observed 8e-6).
"""
import os
import random

import _dist_worker as w
import _fsdp2_jobs as jobs
import pytest
import torch

import amp_patch
from amp_patch.parallel.fsdp2 import fully_shard

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
STOP = random.randrange(1, jobs.STEPS)  # where the resumed run checkpoints (reported in failures)


class _Scenarios(dict):
    """One rank's results; a scenario that raised fails the tests reading it, with its traceback."""

    def __getitem__(self, name):
        result = dict.__getitem__(self, name)
        if isinstance(result, dict) and "error" in result:
            pytest.fail(f"scenario {name!r} raised on a rank:\n{result['error']}")
        return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsdp2")
    results = w.run_ranks("_fsdp2_jobs:main", path, timeout=120, stop=STOP, path=str(path / "ckpt"))
    return [_Scenarios(r) for r in results]


def test_o2_on_fsdp2_follows_ddp_o2(ranks):
    """Two losses, accumulation without gradient sync, an inf on rank 1, clip_grad_norm_ via master_params."""
    for rank in ranks:
        _follows_ddp(rank)


def test_unscaling_sharded_grads_warns_nothing(ranks):
    """The found-inf flag meets each grad's local shard, not a DTensor (torch warned at every step)."""
    assert ranks[0]["fsdp"]["warnings"] == [] and ranks[1]["fsdp"]["warnings"] == []


def _follows_ddp(rank):
    ddp, fsdp = rank["ddp"], rank["fsdp"]
    assert ddp["skipped"] == fsdp["skipped"] == jobs.SKIPPED
    finite = [step for step, skip in zip(fsdp["losses"], jobs.SKIPPED) if not skip]
    ref = [step for step, skip in zip(ddp["losses"], jobs.SKIPPED) if not skip]
    torch.testing.assert_close(torch.tensor(finite), torch.tensor(ref), rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.tensor(fsdp["norms"]), torch.tensor(ddp["norms"]), rtol=1e-3, atol=0)
    for a, b in zip(fsdp["params"], ddp["params"]):
        assert a.dtype is b.dtype is torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@pytest.mark.skipif(os.environ.get("AMP_PATCH_FSDP2_4RANKS") != "1",
                    reason="opt-in (AMP_PATCH_FSDP2_4RANKS=1): 4 processes on the 2-core CI box take ~1 min")
def test_four_ranks_o2_on_fsdp2_follows_ddp_o2(tmp_path):
    ranks = w.run_ranks("_fsdp2_jobs:four", tmp_path, world=4, timeout=300)
    for rank in ranks:
        _follows_ddp(rank)
    for other in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["fsdp"]["params"], other["fsdp"]["params"]))


def test_ranks_agree_bitwise_and_skip_the_same_steps(ranks):
    """Rank 1's inf skips the step on both ranks: in its data (once in a synced micro-batch, once in one without
    gradient sync) and in its own shard of the reduced grads only (rank 0 sees nothing: agree_overflow decides)."""
    r0, r1 = ranks[0]["fsdp"], ranks[1]["fsdp"]
    assert r0["skipped"] == r1["skipped"] == jobs.SKIPPED
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
    assert r0["amp"] == r1["amp"]
    assert r0["amp"]["loss_scaler0"]["skipped_steps"] == 1 and r0["amp"]["loss_scaler1"]["skipped_steps"] == 2
    skips = [(loss_id, skipped) for loss_id, skipped, _ in r0["history"]]
    assert skips == [(0, False), (1, False), (0, False), (0, True), (1, True), (1, True), (0, False)]


def test_o2_layout_sharded_fp32_masters_half_compute_kept_fp32_norm(ranks):
    layout = ranks[0]["fsdp"]["layout"]
    assert layout["sharded_dtypes"] == ["torch.float32"]  # the sharded params are the masters: no second copy
    assert layout["opt_params_are_model_params"]
    assert layout["io"]["1"] == ("torch.float32", "torch.float16")  # the LayerNorm: fp32 in, half out
    assert all(layout["io"][n] == ("torch.float16", "torch.float16") for n in "02345")
    assert layout["out"] == "torch.float32"  # Apex's cast_model_outputs default


def test_diagnose_overflow_history_and_trace_on_fsdp2(ranks):
    r0, r1 = ranks[0]["fsdp"], ranks[1]["fsdp"]
    assert [o["module"] for o in r1["overflows"]] == ["0", "0", None]  # the inf entered the first Linear on rank 1
    assert [o["module"] for o in r0["overflows"]] == [None, None, None]  # rank 0's forward was finite
    assert "0.weight" in r0["overflows"][0]["params"]  # the data's inf reached rank 0's shard of the grads
    assert r1["overflows"][2]["params"] == ["0.weight"] and r0["overflows"][2]["params"] == []  # rank 1's shard
    # steps 2 and 3 both skip for the inf in micro-batch 0's data (its loss is inf): step 3's micro-batch 0 is
    # accumulated without gradient sync (a delayed exit), and its loss still names the cause
    assert [kind for _, skipped, kind in r1["history"] if skipped] == ["loss", "loss", "grads"]
    assert "trace() needs O1 casting" in r0["trace"]  # as under plain O2: trace() records O1's casts


def test_checkpoint_resume_is_bitwise(ranks):
    """DCP (get_state_dict/set_state_dict) + amp_patch.state_dict(), resumed into a model built from another seed."""
    for rank in ranks:
        straight, resumed = rank["fsdp"], rank["resume"]
        assert resumed["skipped"] == straight["skipped"], STOP
        assert resumed["amp"] == straight["amp"], STOP
        for a, b in zip(resumed["params"], straight["params"]):
            assert torch.equal(a, b), f"resumed after step {STOP}"
        assert resumed["opt"].keys() == straight["opt"].keys()
        for key, value in straight["opt"].items():
            assert torch.equal(torch.as_tensor(resumed["opt"][key]), torch.as_tensor(value)), (key, STOP)


def test_o3_on_fsdp2_half_params_half_grads_no_masters(ranks):
    for rank in ranks:
        o3 = rank["o3"]
        assert o3["dtypes"] == o3["grad_dtypes"] == ["torch.float16"]
        assert o3["masters_are_params"] and all(o3["changed"])
        assert o3["bn"] == ("torch.float16", "torch.float16", True)  # buffers cast too, as plain O3
        assert all(torch.isfinite(torch.tensor(o3["losses"])))


def test_groups_kept_fp32_modules_and_batchnorm_get_their_own(ranks):
    groups, o1 = ranks[0]["groups"]
    assert o1 == [("0", True), ("3", True), ("5", True), ("<root>", True)]  # O1: the Linears and the root, no policy
    bf16, fp32 = "torch.bfloat16", "torch.float32"
    assert groups == {"<root>": (bf16, fp32, fp32, True, fp32),  # root: half compute, fp32 reduce, fp32 output
                      "1": ("None", "None", "None", False, fp32),  # BatchNorm: fp32 params on the half input
                      "2": (bf16, fp32, "None", True, fp32),  # the wrapped block
                      "2.1": (fp32, fp32, bf16, True, fp32)}  # keep_fp32_modules: fp32 in, half out


@pytest.mark.parametrize("case,expected", [
    ("none O2", "amp_patch.fully_shard(model, opt_level='O2'"),
    ("none O3", "amp_patch.fully_shard(model, opt_level='O3')"),
    ("half reduce O2", "set reduce_dtype=torch.float32"),
    ("bf16 policy, fp16 init", "pass half_dtype=torch.float16"),
    ("O2 layout O3", "Pass opt_level='O2'"),
    ("remainder", "ConfigError: master_weights='remainder' on an FSDP2-sharded model is not supported yet"),
    ("half params O1", "holds torch.float16 sharded params, but opt_level='O1' expects float32"),
    ("already sharded", "already (partly) sharded"),
    ("mixed", "FSDP2-sharded and unsharded models together"),
    ("keep not sharded", "Pass keep_fp32_modules to amp_patch.fully_shard(model, opt_level='O2'"),
    ("loss id switch in accumulation", "UsageError: scale_loss(..., loss_id=1) while FSDP2 holds gradients"),
])
def test_incompatible_sharding_is_refused_with_the_fix(ranks, case, expected):
    assert expected in (ranks[0]["refusals"][case] or ""), ranks[0]["refusals"][case]


def test_a_user_policy_compatible_with_o2_is_accepted(ranks):
    assert ranks[0]["refusals"]["user policy O2"] is None


@pytest.mark.parametrize("kwargs,error,expected", [
    ({"opt_level": "O4"}, amp_patch.ConfigError, "is not an opt level"),
    ({"wrap": "Linear"}, amp_patch.ConfigError, "wrap='Linear'"),
    ({"wrap": (int,)}, amp_patch.ConfigError, "pass the block classes"),
    ({"opt_level": "O1", "keep_fp32_modules": (torch.nn.LayerNorm,)}, amp_patch.ConfigError, "does not cast"),
    ({"cast_model_outputs": torch.int8}, amp_patch.ConfigError, "cast_model_outputs=torch.int8"),
    ({"reshard_after_forward": "yes"}, amp_patch.ConfigError, "reshard_after_forward='yes'"),
    ({"half_dtype": torch.float64}, amp_patch.ConfigError, "half_dtype=torch.float64"),
    ({}, amp_patch.UsageError, "needs a process group"),  # all arguments fine: the group is checked last
])
def test_wrong_arguments_name_what_is_allowed(kwargs, error, expected):
    with pytest.raises(error) as info:
        fully_shard(torch.nn.Linear(2, 2), **kwargs)
    assert expected in str(info.value)


def test_a_half_model_is_refused_before_sharding():
    with pytest.raises(amp_patch.UsageError, match="expects the float32 model"):
        fully_shard(torch.nn.Linear(2, 2).half())
    with pytest.raises(amp_patch.ConfigError, match="expects an nn.Module"):
        fully_shard("model")
