"""Tests of amp_patch.scaling.scaler: the loss-scale state machine, unscaling, checkpoints, logging, validation."""
import io
import logging
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import amp_patch.scaling.scaler as scaler_mod
import amp_patch.scaling.unscale as unscale_mod
from amp_patch.errors import ConfigError, UsageError
from amp_patch.scaling.scaler import LossScaler, load_state_dict_into, state_dict_for, unscale_, unscale_into

INF, NAN = float("inf"), float("nan")
HALF_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def reference(pattern, *, init=2.0 ** 16, lo=None, hi=2.0 ** 24, up=2.0, down=0.5, interval=2000, hyst=1):
    """Independent re-statement of the documented algorithm: list of (scale after step, skipped)."""
    scale = min(init, hi) if lo is None else max(lo, min(init, hi))
    clean_run, overflow_budget, trace = 0, hyst, []
    for overflow in pattern:
        if overflow:
            clean_run = 0
            overflow_budget = max(0, overflow_budget - 1)
            if overflow_budget == 0:
                scale = scale * down if lo is None else max(lo, scale * down)
        else:
            overflow_budget = hyst
            clean_run += 1
            if clean_run == interval:
                scale, clean_run = min(hi, scale * up), 0
        trace.append((scale, overflow))
    return trace



def trace_of(scaler, pattern):
    out = []
    for overflow in pattern:
        skipped = scaler.update(overflow)
        out.append((scaler.scale, skipped))
    return out


SCRIPTED = [False] * 7 + [True] + [False] * 2 + [True, True, True] + [False] * 4 + [True] * 12 + [False] * 30 \
    + [True, False] * 5 + [True, True, False, True, True, True] + [False] * 40


# ----------------------------------------------------------------------------- state machine
@pytest.mark.parametrize("hyst", [1, 2, 3])
@pytest.mark.parametrize("lo,hi,init", [(None, 2.0 ** 24, 2.0 ** 16), (8.0, 64.0, 16.0), (2.0, 32.0, 1024.0),
                                        (0.25, 2.0 ** 10, 1.0)])
def test_scripted_sequence_matches_reference(hyst, lo, hi, init):
    scaler = LossScaler(init_scale=init, min_loss_scale=lo, max_loss_scale=hi, growth_interval=3,
                        hysteresis=hyst, log_interval=0)
    assert trace_of(scaler, SCRIPTED) == reference(SCRIPTED, init=init, lo=lo, hi=hi, interval=3, hyst=hyst)
    assert scaler.skipped_steps == sum(SCRIPTED)
    assert scaler.steps == len(SCRIPTED)


def test_hand_checked_sequence_with_hysteresis_two():
    s = LossScaler(init_scale=8.0, min_loss_scale=2.0, max_loss_scale=32.0, growth_interval=3, hysteresis=2)
    pattern = "...x.xxxxx......"
    got = [(s.update(c == "x"), s.scale) for c in pattern]
    assert got == [(False, 8.0), (False, 8.0), (False, 16.0),          # grows after 3 clean steps
                   (True, 16.0), (False, 16.0),                       # 1st overflow: skipped, no backoff
                   (True, 16.0), (True, 8.0), (True, 4.0), (True, 2.0), (True, 2.0),  # then every one backs off
                   (False, 2.0), (False, 2.0), (False, 4.0), (False, 4.0), (False, 4.0), (False, 8.0)]


def test_overflow_resets_growth_tracker_and_growth_is_capped():
    s = LossScaler(init_scale=16.0, max_loss_scale=32.0, growth_interval=3, hysteresis=2)
    for overflow in (False, False, True, False, False):   # overflow interrupts the clean run
        s.update(overflow)
    assert s.scale == 16.0
    s.update(False)
    assert s.scale == 32.0
    for _ in range(9):
        s.update(False)
    assert s.scale == 32.0


@pytest.mark.parametrize("init,lo,hi,expected", [(2.0 ** 16, None, 2.0 ** 24, 2.0 ** 16),
                                                 (2.0 ** 16, None, 2.0 ** 10, 2.0 ** 10),
                                                 (2.0 ** 16, 2.0 ** 20, 2.0 ** 24, 2.0 ** 20)])
def test_dynamic_start(init, lo, hi, expected):
    s = LossScaler("dynamic", init_scale=init, min_loss_scale=lo, max_loss_scale=hi)
    assert s.dynamic and s.scale == expected and isinstance(s.scale, float)


def test_backoff_never_reaches_zero_without_min():
    s = LossScaler(log_interval=1e9)
    for _ in range(3000):
        assert s.update(True) is True
    assert s.scale == scaler_mod.SCALE_FLOOR > 0


@pytest.mark.parametrize("value", [128.0, 128, "128.0", " 1e3 ", 1.0])
def test_static_scale_never_changes(value):
    s = LossScaler(value, growth_interval=1, log_interval=1e9)
    expected = float(str(value).strip())
    assert not s.dynamic and s.scale == expected
    for overflow in [False] * 5 + [True] * 5 + [False, True] * 5:
        assert s.update(overflow) is overflow
        assert s.last_overflow is overflow
        assert s.scale == expected
    assert s.skipped_steps == 10


@settings(max_examples=60, deadline=None)
@given(pattern=st.lists(st.booleans(), max_size=80), hyst=st.integers(1, 4), interval=st.integers(1, 5),
       lo=st.sampled_from([None, 1.0, 4.0]), hi=st.sampled_from([64.0, 2.0 ** 20]))
def test_random_patterns_match_reference(pattern, hyst, interval, lo, hi):
    s = LossScaler(init_scale=16.0, min_loss_scale=lo, max_loss_scale=hi, growth_interval=interval,
                   hysteresis=hyst, growth_factor=4.0, backoff_factor=0.25, log_interval=1e9)
    assert trace_of(s, pattern) == reference(pattern, init=16.0, lo=lo, hi=hi, up=4.0, down=0.25,
                                             interval=interval, hyst=hyst)


# ----------------------------------------------------------------------------- unscaling
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_unscale_exact_for_powers_of_two(dtype):
    s = LossScaler(init_scale=2.0 ** 10)
    values = torch.tensor([1024.0, -2048.0, 3.0 * 1024, 0.0, 2.0 ** 14], dtype=dtype)
    grad = values.clone()
    assert s.unscale_grads([grad]) is False
    assert grad.dtype == dtype
    assert torch.equal(grad, (values.double() / 1024.0).to(dtype))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_unscale_finds_non_finite(dtype, bad):
    grads = [torch.ones(4, dtype=dtype), torch.tensor([1.0, bad, 2.0], dtype=dtype)]
    assert unscale_(grads, 4.0) is True
    assert unscale_([torch.ones(4, dtype=dtype)], 4.0) is False


def test_one_inf_among_many_mixed_dtypes():
    rng = random.Random(0)
    grads = [torch.randn(rng.randint(1, 50), dtype=HALF_DTYPES[i % 3]) for i in range(60)]
    clean = [g.clone() for g in grads]
    assert unscale_(clean, 2.0) is False
    grads[37][-1] = INF
    assert unscale_(grads, 2.0) is True


def test_none_entries_skipped_and_duplicates_unscaled_once():
    g = torch.full((3,), 8.0)
    assert unscale_([None, g, None, g], 4.0) is False
    assert torch.equal(g, torch.full((3,), 2.0))
    assert unscale_([None, None], 4.0) is False
    assert unscale_([], 4.0) is False


def test_non_tensor_grad_is_a_usage_error():
    with pytest.raises(UsageError, match=r"grads\[1\] is a list"):
        unscale_([torch.ones(1), [1.0]], 2.0)


def test_at_most_one_host_sync(monkeypatch):
    calls = []
    original = torch.Tensor.item

    def counting_item(self):
        calls.append(1)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    grads = [torch.ones(5, dtype=HALF_DTYPES[i % 3]) for i in range(30)]
    unscale_(grads, 2.0)
    assert len(calls) == 1
    unscale_into(grads, [None] * 30, 2.0)
    assert len(calls) == 2


def test_fallback_without_fused_kernel(monkeypatch):
    def missing(*args):
        raise NotImplementedError("no kernel for this backend")

    monkeypatch.setattr(unscale_mod, "_NO_KERNEL", set())
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", missing)
    for dtype in HALF_DTYPES:
        g = torch.tensor([4.0, 8.0], dtype=dtype)
        assert unscale_([g], 4.0) is False
        assert torch.equal(g, torch.tensor([1.0, 2.0], dtype=dtype))
        assert unscale_([torch.tensor([1.0, NAN], dtype=dtype), g], 4.0) is True
    assert unscale_mod._NO_KERNEL == {"cpu"}


def test_sparse_grad_unscaled():
    g = torch.sparse_coo_tensor([[0, 2]], [4.0, 8.0], (3,), check_invariants=True)
    assert unscale_([g], 4.0) is False
    assert torch.equal(g.to_dense(), torch.tensor([1.0, 0.0, 2.0]))
    assert unscale_([torch.sparse_coo_tensor([[1]], [INF], (3,), check_invariants=True)], 4.0) is True


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_out_mode_creates_fp32_and_leaves_grads(dtype):
    s = LossScaler(init_scale=8.0)
    grads = [torch.tensor([8.0, 16.0], dtype=dtype), None, torch.tensor([24.0], dtype=dtype)]
    before = [g.clone() if g is not None else None for g in grads]
    out = [None, None, None]
    assert s.unscale_grads(grads, out=out) is False
    assert out[1] is None
    assert out[0].dtype == out[2].dtype == torch.float32
    assert torch.equal(out[0], torch.tensor([1.0, 2.0])) and torch.equal(out[2], torch.tensor([3.0]))
    assert all(torch.equal(a, b) for a, b in zip(grads[::2], before[::2]))


def test_out_mode_accumulates_into_existing():
    existing = torch.tensor([0.5, 0.25])
    out = [existing, None]
    grads = [torch.tensor([8.0, 4.0], dtype=torch.float16), torch.tensor([4.0], dtype=torch.bfloat16)]
    assert unscale_into(grads, out, 4.0) is False
    assert out[0] is existing
    assert torch.equal(existing, torch.tensor([2.5, 1.25]))
    assert torch.equal(out[1], torch.tensor([1.0]))
    assert unscale_into([torch.tensor([1.0, INF], dtype=torch.float16), None], out, 4.0) is True
    assert unscale_into((torch.ones(2),), (existing,), 1.0) is False   # tuple fine when nothing is created
    half_out = [torch.ones(2, dtype=torch.float16)]   # an existing out keeps its dtype
    assert unscale_into([torch.full((2,), 4.0, dtype=torch.float16)], half_out, 4.0) is False
    assert torch.equal(half_out[0], torch.full((2,), 2.0, dtype=torch.float16))


def test_out_mode_misuse():
    with pytest.raises(UsageError, match="out has 1 entries but grads has 2"):
        unscale_into([torch.ones(1), torch.ones(1)], [None], 2.0)
    with pytest.raises(UsageError, match=r"out\[0\] is None.*pass a list"):
        unscale_into([torch.ones(1)], (None,), 2.0)
    with pytest.raises(UsageError, match=r"out\[0\] has shape \(3,\) but grads\[0\] has shape \(2,\)"):
        unscale_into([torch.ones(2)], [torch.zeros(3)], 2.0)


def test_randomized_thousand_steps():
    rng = random.Random(1234)
    s = LossScaler(init_scale=2.0 ** 12, min_loss_scale=2.0 ** -4, max_loss_scale=2.0 ** 14, growth_interval=7,
                   hysteresis=2, log_interval=1e9)
    injected, pattern = 0, []
    for _ in range(1000):
        scale = s.scale
        grads = [(torch.randn(rng.randint(1, 9)) * scale).to(rng.choice(HALF_DTYPES)) for _ in range(4)]
        grads.insert(rng.randint(0, 4), None)
        expected = [None if g is None else (g.double() / scale).to(g.dtype) for g in grads]
        poison = rng.random() < 0.3
        if poison:
            victim = rng.choice([g for g in grads if g is not None])
            victim[rng.randrange(victim.numel())] = rng.choice([INF, -INF, NAN])
            injected += 1
        found = s.unscale_grads(grads)
        assert found is poison
        if not poison:
            assert all(g is None or torch.equal(g, e) for g, e in zip(grads, expected))
        pattern.append(found)
        s.update(found)
        assert 2.0 ** -4 <= s.scale <= 2.0 ** 14
    assert s.skipped_steps == injected > 200
    want = reference(pattern, init=2.0 ** 12, lo=2.0 ** -4, hi=2.0 ** 14, interval=7, hyst=2)[-1][0]
    assert s.scale == want


# ----------------------------------------------------------------------------- checkpoints
def make(**kw):
    base = dict(init_scale=64.0, min_loss_scale=1.0, max_loss_scale=2.0 ** 10, growth_interval=4, hysteresis=3,
                log_interval=1e9)
    base.update(kw)
    return LossScaler(**base)


@pytest.mark.parametrize("cut", range(0, len(SCRIPTED), 3))
def test_state_dict_round_trip_continues_identically(cut):
    whole, first = make(), make()
    trace_of(first, SCRIPTED[:cut])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = LossScaler(log_interval=1e9)   # defaults differ: the checkpoint restores the knobs
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    full = trace_of(whole, SCRIPTED)
    assert trace_of(resumed, SCRIPTED[cut:]) == full[cut:]
    assert resumed.state_dict() == whole.state_dict()


def test_state_dict_contents_mid_growth_and_hysteresis():
    s = make()
    trace_of(s, [False, False, True, True])
    sd = s.state_dict()
    assert sd["hysteresis_tracker"] == 1 and sd["unskipped"] == sd["growth_tracker"] == 0
    trace_of(s, [False, False])
    sd = s.state_dict()
    assert sd["loss_scale"] == 64.0 and sd["unskipped"] == 2 and sd["hysteresis_tracker"] == 3
    assert sd["dynamic"] is True and sd["skipped_steps"] == 2 and sd["steps"] == 6
    assert {k: sd[k] for k in ("min_loss_scale", "max_loss_scale", "growth_interval", "hysteresis")} == \
        {"min_loss_scale": 1.0, "max_loss_scale": 1024.0, "growth_interval": 4, "hysteresis": 3}


def test_apex_format_loads():
    s = LossScaler(growth_interval=10)
    s.load_state_dict({"loss_scale": 1024.0, "unskipped": 7})
    assert s.scale == 1024.0
    trace_of(s, [False, False])
    assert s.scale == 1024.0
    s.update(False)
    assert s.scale == 2048.0
    static = LossScaler(128.0)
    static.load_state_dict({"loss_scale": 1.0, "unskipped": 0})   # Apex overwrote the static scale too
    assert static.scale == 1.0


def test_bad_per_scaler_dicts_raise_and_change_nothing():
    s = make()
    trace_of(s, [False, True])
    before = s.state_dict()
    with pytest.raises(ConfigError, match=r"unknown key 'loss_scael'.*allowed keys: .*loss_scale"):
        s.load_state_dict({"loss_scale": 8.0, "loss_scael": 8.0})
    with pytest.raises(ConfigError, match="missing required key 'loss_scale'"):
        s.load_state_dict({"unskipped": 3})
    with pytest.raises(ConfigError, match="loss_scale=-4.0 is not valid"):
        s.load_state_dict({"loss_scale": -4.0, "unskipped": 3})
    with pytest.raises(ConfigError, match="growth_interval=0 is not valid"):
        s.load_state_dict({"loss_scale": 4.0, "growth_interval": 0})
    with pytest.raises(ConfigError, match="unskipped=1 and growth_tracker=2 disagree"):
        s.load_state_dict({"loss_scale": 4.0, "unskipped": 1, "growth_tracker": 2})
    with pytest.raises(ConfigError, match="saved by a static loss scaler but this session's scaler is dynamic"):
        s.load_state_dict(LossScaler(8.0).state_dict())
    with pytest.raises(ConfigError, match="must be a dict, got list"):
        s.load_state_dict([1.0])
    with pytest.raises(ConfigError, match="dict of all loss scalers"):
        s.load_state_dict({"loss_scaler0": {"loss_scale": 1.0}})
    assert s.state_dict() == before


def test_out_of_range_checkpoint_scale_is_clamped(caplog):
    s = LossScaler(max_loss_scale=2.0 ** 10)
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        s.load_state_dict({"loss_scale": 2.0 ** 16, "unskipped": 0})
    assert s.scale == 2.0 ** 10
    assert "outside [min_loss_scale, max_loss_scale]" in caplog.text


def test_all_scalers_round_trip():
    a = [make(loss_id=0), make(loss_id=1), make(loss_id=2)]
    trace_of(a[1], [True, True, True, True])
    trace_of(a[2], [False] * 5)
    sd = state_dict_for(a)
    assert list(sd) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    b = [make(loss_id=i) for i in range(3)]
    load_state_dict_into(b, sd)
    assert [x.state_dict() for x in b] == [x.state_dict() for x in a]
    assert [x.scale for x in b] == [64.0, 16.0, 128.0]


def test_all_scalers_errors_are_precise_and_atomic():
    session = [make(loss_id=0), make(loss_id=1)]
    three = state_dict_for([make(), make(), make()])
    with pytest.raises(ConfigError, match=r"checkpoint has 3 loss scaler\(s\) but this session has 2.*num_losses=3"):
        load_state_dict_into(session, three)
    with pytest.raises(ConfigError, match=r"unexpected key 'scaler1'.*'loss_scaler0'..'loss_scaler1'"):
        load_state_dict_into(session, {"loss_scaler0": three["loss_scaler0"], "scaler1": {}})
    with pytest.raises(ConfigError, match="missing 'loss_scaler1'"):
        load_state_dict_into(session, {"loss_scaler0": three["loss_scaler0"], "loss_scaler2": {}})
    with pytest.raises(ConfigError, match="single loss scaler's state dict"):
        load_state_dict_into(session, make().state_dict())
    with pytest.raises(ConfigError, match="unexpected key 'loss_scaler01'"):
        load_state_dict_into(session, {"loss_scaler0": {}, "loss_scaler01": {}})
    bad = {"loss_scaler0": {"loss_scale": 2.0}, "loss_scaler1": {"loss_scale": "x"}}
    with pytest.raises(ConfigError, match="loss scaler 1 state dict: loss_scale='x'"):
        load_state_dict_into(session, bad)
    assert session[0].scale == 64.0   # nothing loaded


# ----------------------------------------------------------------------------- logging
class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def overflow_records(caplog):
    return [r for r in caplog.records if r.name == "amp_patch" and "Gradient overflow" in r.getMessage()]


def test_overflow_log_line(caplog):
    s = LossScaler(loss_id=3)
    with caplog.at_level(logging.INFO, logger="amp_patch"):
        s.update(True)
    (record,) = overflow_records(caplog)
    assert record.getMessage() == ("Gradient overflow: skipping step, loss scaler 3 reducing loss scale "
                                   "from 65536.0 to 32768.0")
    assert "\n" not in record.getMessage()


def test_overflow_log_rate_limited(caplog, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(LossScaler, "_clock", clock)
    s = LossScaler(loss_id=1, log_interval=10.0)
    with caplog.at_level(logging.INFO, logger="amp_patch"):
        for _ in range(50):
            s.update(True)
            clock.now += 0.01
        assert len(overflow_records(caplog)) == 1
        clock.now += 10.0
        s.update(True)
    records = overflow_records(caplog)
    assert len(records) == 2
    assert "49 similar message(s) suppressed" in records[1].getMessage()
    assert "loss scaler 1" in records[1].getMessage()


def test_log_every_overflow_and_levels(caplog):
    static = LossScaler(128.0, loss_id=2, log_interval=0)
    hyst = LossScaler(hysteresis=2, log_interval=0)
    floor = LossScaler(init_scale=1.0, min_loss_scale=1.0, log_interval=0)
    with caplog.at_level(logging.INFO, logger="amp_patch"):
        static.update(True)
        static.update(True)
        hyst.update(True)
        floor.update(True)
    msgs = [(r.levelno, r.getMessage()) for r in overflow_records(caplog)]
    assert msgs[0] == (logging.WARNING, "Gradient overflow: skipping step, loss scaler 2 keeping static loss "
                                        "scale 128.0")
    assert msgs[1] == msgs[0]
    assert msgs[2][0] == logging.INFO and "keeping loss scale 65536.0 (hysteresis" in msgs[2][1]
    assert msgs[3][0] == logging.WARNING and "already at min_loss_scale" in msgs[3][1]


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("value,pattern", [
    ("dyanmic", r"loss_scale='dyanmic' is not valid.*Did you mean loss_scale='dynamic'"),
    (-1, r"loss_scale=-1 is not valid: expected a positive finite number.*loss_scale='dynamic'"),
    (0, r"loss_scale=0 is not valid"),
    (NAN, r"loss_scale=nan is not valid"),
    (INF, r"loss_scale=inf is not valid"),
    ("nan", r"loss_scale='nan' is not valid"),
    ("abc", r"loss_scale='abc' is not valid: expected 'dynamic' or a number\. Pass"),
    (None, r"loss_scale=None is not valid: expected a positive finite number.*, got NoneType"),
    (True, r"loss_scale=True is not valid:.*got bool"),
])
def test_bad_loss_scale(value, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        LossScaler(value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(growth_factor=0.5), r"growth_factor=0.5 is not valid: expected a finite number > 1.*swap"),
    (dict(growth_factor=1.0), r"growth_factor=1.0 is not valid"),
    (dict(backoff_factor=2.0), r"backoff_factor=2.0 is not valid: expected a number strictly between 0 and 1"),
    (dict(backoff_factor=0), r"backoff_factor=0 is not valid"),
    (dict(backoff_factor="0.5"), r"backoff_factor='0.5' is not valid: expected a number strictly between 0 and 1"
                                 r".*, got str"),
    (dict(min_loss_scale=2.0 ** 20, max_loss_scale=2.0 ** 10), r"min_loss_scale=1048576.0 is greater than "
                                                                r"max_loss_scale=1024.0"),
    (dict(min_loss_scale=0.0), r"min_loss_scale=0.0 is not valid"),
    (dict(max_loss_scale=INF), r"max_loss_scale=inf is not valid.*larger finite value"),
    (dict(init_scale=-1.0), r"init_scale=-1.0 is not valid"),
    (dict(growth_interval=0), r"growth_interval=0 is not valid: expected an integer >= 1"),
    (dict(growth_interval=2.5), r"growth_interval=2.5 is not valid"),
    (dict(hysteresis=0), r"hysteresis=0 is not valid"),
    (dict(loss_id=-1), r"loss_id=-1 is not valid"),
    (dict(log_interval=-1.0), r"log_interval=-1.0 is not valid"),
])
def test_bad_knobs(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        LossScaler(**kwargs)


def test_accepted_spellings():
    assert LossScaler("Dynamic").dynamic
    assert LossScaler(growth_interval=3.0).state_dict()["growth_interval"] == 3
    assert LossScaler("2.5").scale == 2.5 and not LossScaler("2.5").dynamic
    assert repr(LossScaler(8.0, loss_id=1)) == "LossScaler(loss_id=1, static, scale=8.0, steps=0, skipped_steps=0)"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_scale_one_checks_without_touching_grads(dtype):
    """A static 1.0 scale only checks (one read pass); large finite half grads must not look like overflow."""
    scaler = LossScaler(1.0)
    big = torch.full((1000,), 60000.0, dtype=dtype)  # its fp16 sum would overflow; the fp32 sum does not
    small = torch.randn(7, dtype=dtype)
    before = [big.clone(), small.clone()]
    assert scaler.unscale_grads([big, small]) is False
    assert torch.equal(big, before[0]) and torch.equal(small, before[1])
    for bad in (float("inf"), float("-inf"), float("nan")):
        poisoned = small.clone()
        poisoned[3] = bad
        assert scaler.unscale_grads([big, poisoned]) is True


def test_rate_limited_overflows_are_reported_when_the_burst_ends(caplog, monkeypatch):
    """Overflow messages never undercount skipped steps: after a rate-limited burst, the first
    clean step (once the interval has passed) logs how many were not logged, and the total."""
    clock = FakeClock()
    monkeypatch.setattr(LossScaler, "_clock", clock)
    s = LossScaler(loss_id=4, log_interval=10.0)
    with caplog.at_level(logging.INFO, logger="amp_patch"):
        for _ in range(5):
            s.update(True)
            clock.now += 1.0
        s.update(False)  # within the interval: not yet
        clock.now += 10.0
        s.update(False)
        s.update(False)  # reported once
    lines = [r.getMessage() for r in caplog.records if r.name == "amp_patch"]
    assert len(lines) == 2 and lines[0].startswith("Gradient overflow")
    assert lines[1] == ("loss scaler 4: 4 more overflow-skipped step(s) after the last 'Gradient overflow' message "
                        "were not logged (rate limit: one message per 10 s); 5 step(s) skipped by this scaler in all")
