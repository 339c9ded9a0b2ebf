"""O2 remainder masters (master_weights="remainder"): the split rule, and bitwise equivalence with fp32-master O2
rounded by the same rule (master_rounding="split"). The training loop lives in tests/_remainder_jobs.py."""
import os

import _dist_worker as w
import _remainder_jobs as jobs
import pytest
import torch

import amp_patch
from amp_patch.errors import ConfigError, UsageError
from amp_patch.weights.storage import join, round_split, split, split_


# -- the split rule -----------------------------------------------------------------------------
def _patterns():
    """Every high 16 bits x a dense sample of low 16 bits (edges, ties, neighbours of the tie, random)."""
    edges = [0, 1, 2, 0x3FFF, 0x4000, 0x7FFE, 0x7FFF, 0x8000, 0x8001, 0x8002, 0xBFFF, 0xC000, 0xFFFE, 0xFFFF]
    low = torch.tensor(edges + torch.randint(0, 0x10000, (50,), generator=torch.Generator().manual_seed(0)).tolist())
    high = torch.arange(0x10000)
    bits = (high[:, None] << 16 | low[None, :]).view(-1)
    return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32), low


def test_split_join_is_exact_over_every_high_half_and_dense_low_halves():
    bits, _ = _patterns()
    master = bits.view(torch.float32)
    weight, rem = split(master)
    back = join(weight, rem).view(torch.int32)
    nan = torch.isnan(master)
    assert torch.equal(back[~nan], bits[~nan])
    # the weight is the bf16 half: high16 + (low16 >= 0x8000), a remainder in int16
    expected = ((bits.to(torch.int64) & 0xFFFFFFFF) >> 16) + ((bits & 0xFFFF) >= 0x8000).to(torch.int64)
    got = weight.view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(got[~nan], expected[~nan])
    assert rem.dtype is torch.int16 and torch.equal(rem.to(torch.int32), ((bits & 0xFFFF) ^ 0x8000) - 0x8000)


def test_the_fast_split_of_finite_masters_is_the_exact_split():
    """After a step with finite masters the split takes a shortcut (lowest bit set, torch's rounding)."""
    bits, _ = _patterns()
    master = bits.view(torch.float32)
    finite = master[torch.isfinite(master)]
    weight, rem = split(finite)
    fast_w, fast_r = torch.empty_like(weight), torch.empty_like(rem)
    split_(finite.clone(), fast_w, fast_r, nan_safe=False)
    assert torch.equal(fast_w.view(torch.int16), weight.view(torch.int16)) and torch.equal(fast_r, rem)
    assert torch.equal(join(fast_w, fast_r).view(torch.int32), finite.view(torch.int32))


def _check_all_low_halves(first_high, count):
    """Every low half under ``count`` high halves from ``first_high``: exact join, and the weight rule."""
    bits = (torch.arange(first_high, first_high + count, dtype=torch.int64)[:, None] << 16
            | torch.arange(0x10000)[None, :]).view(-1)
    bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
    master = bits.view(torch.float32)
    weight, rem = split(master)
    ok = ~torch.isnan(master)
    assert torch.equal(join(weight, rem).view(torch.int32)[ok], bits[ok])
    expected = ((bits.to(torch.int64) & 0xFFFFFFFF) >> 16) + ((bits & 0xFFFF) >= 0x8000).to(torch.int64)
    assert torch.equal((weight.view(torch.int16).to(torch.int64) & 0xFFFF)[ok], expected[ok])
    assert torch.isnan(weight[~ok].float()).all()


@pytest.mark.skipif(os.environ.get("AMP_PATCH_EXHAUSTIVE") != "1",
                    reason="opt-in (AMP_PATCH_EXHAUSTIVE=1): 256 chunks of 2**24 patterns, "
                           "7 s each on the loaded 2-core CI box")
def test_split_join_over_all_2_to_32_bit_patterns():
    for first in range(0, 0x10000, 256):
        _check_all_low_halves(first, 256)


def test_every_low_half_around_the_edges_of_the_high_halves():
    """All 65536 low halves under the high halves of zero, the smallest normals, one, the largest finite, inf
    and NaN, positive and negative (the full 2**32 check is opt-in above)."""
    for first in (0x0000, 0x007F, 0x3F7F, 0x7F7E, 0x7FFE, 0x8000, 0x807F, 0xBF7F, 0xFF7E, 0xFFFE):
        _check_all_low_halves(first, 2)


def test_nan_stays_nan_and_inf_stays_inf():
    bits, _ = _patterns()
    master = bits.view(torch.float32)
    weight, rem = split(master)
    nan = torch.isnan(master)
    assert nan.sum() == 2 * (127 * 64 + 63)  # NaNs with payloads in the low half only included (0x7F800001 ...)
    assert torch.isnan(weight[nan].float()).all() and torch.isnan(join(weight, rem)[nan]).all()
    edges = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, float("nan")])
    weight, rem = split(edges)
    assert torch.equal(weight.float()[:4], edges[:4]) and torch.equal(rem[:4], torch.zeros(4, dtype=torch.int16))
    assert torch.equal(join(weight, rem)[:4].view(torch.int32), edges[:4].view(torch.int32))  # -0.0 keeps its sign
    big = torch.tensor([torch.finfo(torch.float32).max])  # rounds up to bf16 inf; the remainder brings it back
    weight, rem = split(big)
    assert torch.isinf(weight.float()).all() and torch.equal(join(weight, rem), big)


def test_split_differs_from_torch_round_to_nearest_even_only_at_ties():
    bits, low = _patterns()
    master = bits.view(torch.float32)
    ours, torch_rne = round_split(master).view(torch.int16), master.to(torch.bfloat16).view(torch.int16)
    finite = torch.isfinite(master)
    tie = (bits & 0xFFFF) == 0x8000
    assert torch.equal(ours[finite & ~tie], torch_rne[finite & ~tie])
    assert (ours[finite & tie] != torch_rne[finite & tie]).any()  # away from zero vs to even


# -- bitwise equivalence with fp32-master O2 rounded by the split rule ----------------------------
def _assert_same(a, b, overflow_at=2):
    assert a["skipped"] == b["skipped"] and a["skipped"][overflow_at]  # the step with inf was skipped
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a["losses"], b["losses"]))
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a["params"], b["params"]))
    assert a["model_state"].keys() == b["model_state"].keys()
    for k in a["model_state"]:
        assert a["model_state"][k].dtype is torch.float32
        assert torch.equal(a["model_state"][k].view(torch.int32), b["model_state"][k].view(torch.int32)), k
    assert a["opt_state"].keys() == b["opt_state"].keys()
    for i, state in a["opt_state"].items():
        for k, v in state.items():
            other = b["opt_state"][i][k]
            assert torch.equal(v, other) if torch.is_tensor(v) else v == other, (i, k)
    assert a["amp_state"] == b["amp_state"]


@pytest.mark.parametrize("opt_name", sorted(jobs.OPTIMIZERS))
def test_remainder_is_bitwise_fp32_masters_with_split_rounding(opt_name):
    _assert_same(jobs.run("remainder", opt_name), jobs.run("split", opt_name))


def test_the_planted_ties_matter():
    """The loop's ties make torch's rounding differ from the split rule: the equivalence above can fail."""
    split_run, nearest = jobs.run("split", "adamw", steps=1), jobs.run("nearest", "adamw", steps=1)
    assert not torch.equal(split_run["losses"][0], nearest["losses"][0])


def test_ddp_two_ranks_remainder_is_bitwise_split(tmp_path):
    results = w.run_ranks("_remainder_jobs:ddp_modes", tmp_path, timeout=120.0)
    for _rank, rank_result in enumerate(results):
        _assert_same(rank_result["remainder"], rank_result["split"])
        for mode in ("remainder", "split"):  # rank 1 built other weights; DDP's construction gave every rank
            # rank 0's, and the masters followed it through the storage
            assert rank_result[mode]["stale"] == [] and rank_result[mode]["synced"] == [], mode
    for a, b in zip(results[0]["remainder"]["params"], results[1]["remainder"]["params"]):
        assert torch.equal(a, b)  # the ranks agree (rank 1 started from other weights)


@pytest.mark.parametrize("first,then", [("remainder", "split"), ("split", "remainder")])
def test_checkpoints_resume_across_modes(first, then):
    model, opt = jobs.setup(first, "adamw")
    try:
        jobs.train_steps(model, opt, 3)  # step 2 overflows: the checkpoint holds a backed-off scaler
        checkpoint = {"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp_patch.state_dict()}
    finally:
        amp_patch.deinitialize()
    model, opt = jobs.setup(then, "adamw", seed=5)
    try:
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["opt"])
        amp_patch.load_state_dict(checkpoint["amp"])
        losses, skipped = jobs.train_steps(model, opt, 3, start=3, inf_at=4)
        resumed = {"losses": losses, "skipped": skipped, **jobs.snapshot(model, opt)}
    finally:
        amp_patch.deinitialize()
    model, opt = jobs.setup(then, "adamw")
    try:
        jobs.train_steps(model, opt, 3)
        losses, skipped = jobs.train_steps(model, opt, 3, start=3, inf_at=4)
        straight = {"losses": losses, "skipped": skipped, **jobs.snapshot(model, opt)}
    finally:
        amp_patch.deinitialize()
    _assert_same(resumed, straight, overflow_at=1)


def test_state_dict_holds_exact_fp32_masters_and_loads_plain_fp32_checkpoints():
    plain = jobs.make_model(seed=3)
    values = {k: v.clone() for k, v in plain.state_dict().items()}
    model, opt = jobs.setup("remainder", "sgd")
    try:
        model.load_state_dict(values)
        for k, v in model.state_dict().items():
            assert v.dtype is torch.float32 and torch.equal(v.view(torch.int32), values[k].view(torch.int32)), k
        for (k, v), p in zip(values.items(), model.parameters()):
            assert torch.equal(p.detach().view(torch.int16), round_split(v).view(torch.int16)), k
    finally:
        amp_patch.deinitialize()
    for p, v in zip(model.parameters(), values.values()):  # deinitialize gives back the exact fp32 masters
        assert p.dtype is torch.float32 and torch.equal(p.detach(), v)


def test_no_fp32_copy_of_weights_or_grads_between_steps():
    model, opt = jobs.setup("remainder", "adamw")
    try:
        jobs.train_steps(model, opt, 1)
        masters = list(amp_patch.master_params(opt))
        assert all(m.untyped_storage().nbytes() == 4 and m.grad is None for m in masters)
        assert all(torch.isnan(m).all() for m in masters)  # placeholders: no value between steps
        assert all(p.dtype is torch.bfloat16 and p.grad is None for p in model.parameters())
    finally:
        amp_patch.deinitialize()


# -- misuse ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,needle", [
    (dict(opt_level="O2", half_dtype=torch.float16, master_weights="remainder"), "bfloat16"),
    (dict(opt_level="O2", master_weights="remainder"), "bfloat16"),  # the default half dtype is float16
    (dict(opt_level="O1", half_dtype=torch.bfloat16, master_weights="remainder"), "O2"),
    (dict(opt_level="O3", half_dtype=torch.bfloat16, master_weights="remainder"), "O2"),
    (dict(opt_level="O2", half_dtype=torch.bfloat16, master_weights="exact"), "'remainder'"),
    (dict(opt_level="O2", half_dtype=torch.bfloat16, master_weights=True, master_rounding="even"), "'split'"),
    (dict(opt_level="O2", half_dtype=torch.float16, master_rounding="split"), "bfloat16"),
    (dict(opt_level="O2", half_dtype=torch.bfloat16, master_weights="remainder", master_rounding="nearest"),
     "master_rounding"),
])
def test_misuse_is_refused_with_the_fix(kwargs, needle):
    model = jobs.make_model()
    with pytest.raises(ConfigError, match=needle):
        amp_patch.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0, **kwargs)
    assert amp_patch.session.api._state.current() is None


def test_param_groups_changed_after_initialize_are_refused():
    model, opt = jobs.setup("remainder", "sgd")
    try:
        extra = torch.nn.Parameter(torch.zeros(3))
        opt.add_param_group({"params": [extra]})
        with pytest.raises(UsageError, match="master_weights=True"):
            jobs.train_steps(model, opt, 1)
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("mode", ["remainder", "split"])
def test_every_step_rounds_masters_to_the_model_by_the_split_rule(mode):
    """SGD with lr=0 keeps the planted ties in the masters at every step, so each step's copy to the model
    (not only the first rounding at initialize) must apply the tie rule."""
    initial = {k: v.clone() for k, v in jobs.make_model().state_dict().items()}
    model = jobs.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
                                      **jobs.MODES[mode])
    try:
        for _ in range(2):
            with amp_patch.scale_loss(model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum(), opt) as s:
                s.backward()
            opt.step()
            opt.zero_grad()
            for (k, v), p in zip(model.state_dict().items(), model.parameters()):
                assert torch.equal(v.view(torch.int32), initial[k].view(torch.int32)), k
                assert torch.equal(p.detach().view(torch.int16), round_split(v).view(torch.int16)), k
    finally:
        amp_patch.deinitialize()


class _WritePatterns(torch.optim.Optimizer):
    """Writes given fp32 bit patterns into its first param (a stand-in for an update that went wrong)."""

    def __init__(self, params, patterns):
        super().__init__(params, {})
        self.patterns = patterns

    @torch.no_grad()
    def step(self, closure=None):
        p = self.param_groups[0]["params"][0]
        p.view(-1)[:len(self.patterns)].view(torch.int32).copy_(self.patterns)


def test_a_step_that_writes_nan_or_inf_masters_keeps_them_non_finite():
    patterns = torch.tensor([0x7F800001, 0x7F807FFF, 0x7FFFFFFF, -1, 0x7F800000, -0x800000, 0x7F7FFFFF],
                            dtype=torch.int64).to(torch.int32)  # NaNs (low-half payloads, max), +-inf, max finite
    model = torch.nn.Linear(4, 4)
    opt = _WritePatterns(model.parameters(), patterns)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
                                      master_weights="remainder")
    try:
        with amp_patch.scale_loss(model(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum(), opt) as s:
            s.backward()
        opt.step()
        weight = model.weight.detach().view(-1)[:7].float()
        assert torch.isnan(weight[:4]).all()
        assert torch.equal(weight[4:6], torch.tensor([float("inf"), -float("inf")])) and torch.isinf(weight[6])
        master = model.state_dict()["weight"].view(-1)[:7]
        assert torch.isnan(master[:4]).all() and torch.equal(master[4:].view(torch.int32), patterns[4:])
    finally:
        amp_patch.deinitialize()


class _OddParams(torch.nn.Module):
    """A 0-dim param on a tie, a transposed (non-contiguous) one and an empty one."""

    def __init__(self):
        super().__init__()
        self.s = torch.nn.Parameter(torch.tensor(1.0 + 2 ** -8 + 2 ** -9))  # low 16 bits exactly 0x8000
        self.w = torch.nn.Parameter(torch.randn(3, 5).t())
        self.e = torch.nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return (x @ self.w) * self.s + self.e.sum()


@pytest.mark.parametrize("mode", ["remainder", "split"])
def test_zero_dim_transposed_and_empty_params(mode):
    model = _OddParams()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
                                      **jobs.MODES[mode])
    try:
        for _ in range(2):
            with amp_patch.scale_loss(model(torch.ones(2, 5, dtype=torch.bfloat16)).float().sum(), opt) as s:
                s.backward()
            opt.step()
            opt.zero_grad()
        assert all(torch.equal(v, initial[k]) for k, v in model.state_dict().items())
        assert model.s.item() == 1.0 + 2 ** -7  # the tie rounded away from zero
    finally:
        amp_patch.deinitialize()


def test_the_experiment_runs_o2_remainder_only_when_named():
    from amp_patch.tools.experiment.variants import VARIANTS, make_variant, parse_variants

    assert "O2-remainder" not in VARIANTS and parse_variants("fp32,O2-remainder") == ("fp32", "O2-remainder")
    variant = make_variant("O2-remainder", torch.bfloat16, "cpu")
    model = jobs.make_model()
    variant.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        session = amp_patch.session.api._state.current()
        assert session.props.master_storage == "remainder" and variant.opt_level == "O2"
    finally:
        variant.close()


def test_weights_written_outside_amp_patch_are_out_of_sync_but_loads_and_steps_are_not():
    model, opt = jobs.setup("remainder", "sgd")
    try:
        assert amp_patch.distributed.masters_out_of_sync() == []
        model.load_state_dict(model.state_dict())
        assert amp_patch.distributed.masters_out_of_sync() == []
        with torch.no_grad():
            model[0].weight.copy_(model[0].weight)  # the same values again: still in sync
            assert amp_patch.distributed.masters_out_of_sync() == []
            model[2].bias.add_(1.0)
        assert amp_patch.distributed.masters_out_of_sync() == ["param 3"]
        jobs.train_steps(model, opt, 1, inf_at=None)  # the step writes every weight from its master again
        assert amp_patch.distributed.masters_out_of_sync() == []
    finally:
        amp_patch.deinitialize()
