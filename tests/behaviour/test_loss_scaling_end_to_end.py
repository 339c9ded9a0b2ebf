"""Loss scaling end to end: control runs with injected infs, accumulation, O2 masters, resume.

Tolerances: fp16 compute of these tiny layers keeps grads within rtol 2e-2 / atol 2e-3 of the fp32
reference (fp16 has an 11-bit significand: 4.9e-4 relative per rounding, a few roundings per value).
Skipped steps and restored state are compared bitwise.
"""
import copy
import random

import pytest
import torch
import torch.nn.functional as F

import amp_patch

RTOL, ATOL = 2e-2, 2e-3


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def fixed_batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


def _step(model, opt, x, y, loss_id=0, grads=None):
    """One iteration; ``grads`` (a list) receives the master grads step() used (it clears them, as Apex did)."""
    opt.zero_grad()
    loss = F.mse_loss(model(x).float(), y)
    with amp_patch.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
    if grads is not None:
        grads[:] = [None if p.grad is None else p.grad.detach().clone() for p in amp_patch.master_params(opt)]
    opt.step()
    return loss


def _grads(opt):
    return [p.grad.detach().clone() for p in amp_patch.master_params(opt)]


def _state_of(opt):
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in amp_patch.master_params(opt)]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_injected_infs_skip_exactly_those_steps_against_a_control_run(level):
    inject = {2, 5}
    data = fixed_batches(8)
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, growth_interval=3, verbosity=0)
    scales, expected_scale, clean = [], 2.0 ** 16, 0
    for i, (x, y) in enumerate(data):
        params_before = [p.detach().clone() for p in amp_patch.master_params(opt)]
        state_before = _state_of(opt)
        grads = []
        _step(model, opt, x * float("inf") if i in inject else x, y, grads=grads)
        scales.append(amp_patch.loss_scale())
        if i in inject:
            assert amp_patch.last_step_skipped(opt)
            assert all(torch.equal(a, b) for a, b in zip(params_before, amp_patch.master_params(opt)))
            assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                       for a, b in zip(state_before, _state_of(opt)))
            expected_scale, clean = expected_scale / 2, 0
            continue
        assert not amp_patch.last_step_skipped(opt)
        clean += 1
        if clean == 3:
            expected_scale, clean = expected_scale * 2, 0
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        for p_ref, g in zip(ref.parameters(), grads, strict=True):
            torch.testing.assert_close(g, p_ref.grad, rtol=RTOL, atol=ATOL)
        ref_opt.step()
        assert scales[-1] == expected_scale
    for p_ref, p in zip(ref.parameters(), amp_patch.master_params(opt)):
        torch.testing.assert_close(p, p_ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_thousand_steps_of_random_inf_nan_never_reach_a_parameter(level):
    rng = random.Random(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, min_loss_scale=4.0, growth_interval=5,
                                      verbosity=0)
    x, y = torch.randn(4, 3) * 0.1, torch.zeros(4, 1)
    injected = skipped = 0
    for _ in range(1000):
        poison = rng.random() < 0.2
        injected += poison
        bad = rng.choice([float("inf"), float("nan"), -float("inf")])
        _step(model, opt, x * bad if poison else x, y)
        skipped += amp_patch.last_step_skipped(opt)
        assert amp_patch.loss_scale() >= 4.0
    assert skipped == injected > 100
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in amp_patch.master_params(opt))


@pytest.mark.parametrize("level,loss_scale", [("O1", None), ("O2", None), ("O2", 1.0), ("O1", 1.0)])
def test_accumulation_over_scale_loss_calls_sums_every_micro_batch(level, loss_scale):
    data = fixed_batches(3)
    ref = _net()
    for x, y in data:
        (F.mse_loss(ref(x), y) / len(data)).backward()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, loss_scale=loss_scale, verbosity=0)
    for x, y in data:
        loss = F.mse_loss(model(x).float(), y) / len(data)
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
    for p_ref, g in zip(ref.parameters(), _grads(opt)):
        torch.testing.assert_close(g, p_ref.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_accumulation_across_loss_ids_with_different_scales(level):
    data = fixed_batches(2)
    ref = _net()
    for x, y in data:
        F.mse_loss(ref(x), y).backward()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, num_losses=2, verbosity=0)
    amp_patch.load_state_dict({"loss_scaler0": {"loss_scale": 2.0 ** 10, "unskipped": 0},
                               "loss_scaler1": {"loss_scale": 2.0 ** 5, "unskipped": 0}})
    for loss_id, (x, y) in enumerate(data):
        with amp_patch.scale_loss(F.mse_loss(model(x).float(), y), opt, loss_id=loss_id) as scaled:
            scaled.backward()
    for p_ref, g in zip(ref.parameters(), _grads(opt)):
        torch.testing.assert_close(g, p_ref.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_delay_unscale_matches_plain_accumulation(level):
    data = fixed_batches(3)
    results = []
    for delay in (False, True):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
        for i, (x, y) in enumerate(data):
            with amp_patch.scale_loss(F.mse_loss(model(x).float(), y), opt,
                                      delay_unscale=delay and i < len(data) - 1) as scaled:
                scaled.backward()
        results.append(_grads(opt))
        amp_patch.deinitialize()
    # O1 accumulates fp32 grads either way; under O2 delayed micro-batches accumulate in the half
    # model grads (scaled) before reaching the fp32 masters, so they agree to half precision only.
    rtol, atol = (1e-6, 1e-7) if level == "O1" else (RTOL, ATOL)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def test_overflow_in_one_loss_touches_only_its_scaler_and_optimizers():
    m1, m2 = _net(1), _net(2)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    (m1, m2), (o1, o2) = amp_patch.initialize([m1, m2], [o1, o2], num_losses=2, max_loss_scale=2.0 ** 10,
                                              verbosity=0)
    x, y = fixed_batches(1)[0]
    before2 = [p.detach().clone() for p in m2.parameters()]
    with amp_patch.scale_loss(F.mse_loss(m1(x * float("inf")).float(), y), o1, loss_id=0) as scaled:
        scaled.backward()
    with amp_patch.scale_loss(F.mse_loss(m2(x).float(), y), o2, loss_id=1) as scaled:
        scaled.backward()
    o1.step()
    o2.step()
    assert amp_patch.loss_scale(0) == 2.0 ** 9 and amp_patch.loss_scale(1) == 2.0 ** 10
    assert amp_patch.last_step_skipped(o1) and not amp_patch.last_step_skipped(o2)
    assert not all(torch.equal(a, b) for a, b in zip(before2, m2.parameters()))


class TestO2:
    def _setup(self, **kwargs):
        model = _net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return amp_patch.initialize(model, opt, opt_level="O2", verbosity=0, **{"max_loss_scale": 2.0 ** 10, **kwargs})

    def test_step_zero_grad_and_scheduler_before_first_backward(self):
        model, opt = self._setup()
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        before = copy.deepcopy(model.state_dict())
        opt.zero_grad()
        opt.step()
        sched.step()
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    def test_add_param_group_after_initialize(self):
        """The params the optimizer holds are the ones it trains: an fp32 module added later trains in fp32 (one
        owner; a half module would train in half, with no hidden master)."""
        model, opt = self._setup()
        extra = torch.nn.Linear(2, 2)
        opt.add_param_group({"params": list(extra.parameters())})
        x, y = fixed_batches(1)[0]
        before = extra.weight.detach().clone()
        opt.zero_grad()
        loss = F.mse_loss(extra(model(x)), y)
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        assert not amp_patch.last_step_skipped(opt)
        masters = list(amp_patch.master_params(opt))
        assert all(p.dtype is torch.float32 for p in masters) and len(masters) == 6
        assert not torch.equal(extra.weight, before) and extra.weight.dtype is torch.float32
        assert masters[-2] is extra.weight

    def test_state_dict_holds_fp32_masters_and_load_updates_them(self):
        model, opt = self._setup()
        for x, y in fixed_batches(3):
            _step(model, opt, x, y)
        sd = model.state_dict()
        masters = list(amp_patch.master_params(opt))
        assert all(v.dtype is torch.float32 for v in sd.values())
        assert torch.equal(sd["0.weight"], masters[0]) and masters[0] is model[0].weight  # one owner
        assert not torch.equal(sd["0.weight"], model[0].weight.half().float())  # not a half round trip
        fresh = _net(seed=7).state_dict()
        model.load_state_dict(fresh)
        assert torch.equal(masters[0], fresh["0.weight"])  # exact fp32 values, not a half round trip
        opt.zero_grad()
        opt.step()  # a step with no grads changes nothing
        assert torch.equal(model[0].weight, fresh["0.weight"])

    def test_master_params_for_clipping(self):
        model, opt = self._setup(loss_scale=1024.0)
        x, y = fixed_batches(1)[0]
        ref = _net()
        F.mse_loss(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        with amp_patch.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        norm = torch.nn.utils.clip_grad_norm_(amp_patch.master_params(opt), 0.01)
        torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL)
        for p_ref, p in zip(ref.parameters(), amp_patch.master_params(opt)):
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=RTOL, atol=ATOL)

    def test_dict_like_outputs_keep_their_type(self):
        from collections import OrderedDict

        class Out(OrderedDict):
            pass

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(2, 2)

            def forward(self, x):
                return Out(logits=self.fc(x))

        model = amp_patch.initialize(Net(), opt_level="O2", verbosity=0)
        out = model(torch.randn(1, 2))
        assert type(out) is Out and out["logits"].dtype is torch.float32


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_in_one_micro_batch_counts_once_and_skips_the_step(level):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, max_loss_scale=2.0 ** 10, verbosity=0)
    before = [p.detach().clone() for p in amp_patch.master_params(opt)]
    for i, (x, y) in enumerate(fixed_batches(3)):
        with amp_patch.scale_loss(F.mse_loss(model(x * float("inf") if i == 0 else x).float(), y), opt) as scaled:
            scaled.backward()
    opt.step()
    assert amp_patch.last_step_skipped(opt) and amp_patch.loss_scale() == 2.0 ** 9
    assert all(torch.equal(a, b) for a, b in zip(before, amp_patch.master_params(opt)))
    assert [r["skipped"] for r in amp_patch.history()] == [True]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_grads_inside_the_block_are_scale_times_the_reference(level):
    x, y = fixed_batches(1)[0]
    ref = _net()
    F.mse_loss(ref(x), y).backward()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, loss_scale=128.0, verbosity=0)
    loss = F.mse_loss(model(x).float(), y)
    with amp_patch.scale_loss(loss, opt) as scaled:
        assert scaled.item() == loss.item() * 128.0
        scaled.backward()
        for p_ref, p in zip(ref.parameters(), model.parameters()):  # still scaled, in the model's own dtype
            torch.testing.assert_close(p.grad.float() / 128.0, p_ref.grad, rtol=RTOL, atol=ATOL)
    masters = list(amp_patch.master_params(opt))
    assert all(m is q for m, q in zip(masters, opt.param_groups[0]["params"]))  # the optimizer steps these
    for p_ref, m in zip(ref.parameters(), masters):  # unscaled on exit, fp32
        assert m.grad.dtype is torch.float32
        torch.testing.assert_close(m.grad, p_ref.grad, rtol=RTOL, atol=ATOL)


class _MatmulOptimizer(torch.optim.SGD):
    """Records the dtype of a half-list op run inside step(); raises when asked to."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.seen, self.fail = [], False

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        p = self.param_groups[0]["params"][0]
        self.seen.append(torch.mm(p.detach(), p.detach().t()).dtype)
        if self.fail:
            raise RuntimeError("step failed")
        super().step()
        return loss


def test_o1_casting_pauses_inside_step_and_always_resumes():
    model = torch.nn.Linear(4, 4)
    opt = _MatmulOptimizer(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", verbosity=0)
    x = torch.randn(2, 4)
    opt.step()
    assert opt.seen == [torch.float32]  # optimizer math is left alone
    assert model(x).dtype is torch.float16 and torch.mm(x, x.t()).dtype is torch.float16
    opt.fail = True
    with pytest.raises(RuntimeError, match="step failed"):
        opt.step()
    assert torch.mm(x, x.t()).dtype is torch.float16  # the failed step did not leave casting paused
    assert model(x).dtype is torch.float16
    opt.fail = False
    dtypes = []
    opt.step(lambda: dtypes.append(model(x).dtype))  # a closure's forward keeps O1 casting
    assert dtypes == [torch.float16] and opt.seen[-1] is torch.float16
