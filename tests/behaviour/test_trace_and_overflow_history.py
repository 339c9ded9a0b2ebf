"""Cast trace, overflow origin and the scale/skip history."""
import logging

import pytest
import torch
import torch.nn.functional as F

import amp_patch


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _overflowing_net():
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.blocks[2].fc.weight.fill_(6e4)  # fits in fp16 (max 65504), but the half linear output does not
        net.blocks[2].fc.bias.fill_(6e4)
    return net


def test_last_overflow_names_the_first_bad_module_and_its_params():
    net = _overflowing_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp_patch.initialize(net, opt, opt_level="O1", diagnose_overflow=True, verbosity=0)
    assert amp_patch.last_overflow() is None
    loss = net(torch.ones(2, 4)).float().sum()
    with amp_patch.scale_loss(loss, opt) as scaled:
        scaled.backward()
    record = amp_patch.last_overflow()
    assert record["first_bad_module"]["module"] == "blocks.2.fc"
    assert record["first_bad_module"]["op"] == "torch.nn.functional.linear"
    assert record["first_bad_module"]["category"] == "half"
    rows = {row["param"]: row for row in record["params"]}
    # the inf flows backward from blocks.2 into every earlier grad and through everything after it
    assert set(rows) == {name for name, _ in net.named_parameters()}
    assert rows["blocks.2.fc.weight"]["nonfinite"] == 16 and rows["blocks.2.fc.bias"]["nonfinite"] == 4


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_nan_in_one_grad_names_exactly_that_param(level):
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp_patch.initialize(net, opt, opt_level=level, diagnose_overflow=True, loss_scale=8.0,
                                    verbosity=0)
    with amp_patch.scale_loss(net(torch.randn(2, 4)).float().sum(), opt) as scaled:
        scaled.backward()
        bias_grad = net.head.weight.grad[0]
        expected_max = float(bias_grad[1:].float().abs().max()) / 8.0  # reported unscaled (8 is a power of 2)
        bias_grad[0] = float("nan")
    record = amp_patch.last_overflow()
    assert expected_max > 0
    assert record["params"] == [{"param": "head.weight", "nonfinite": 1, "max_finite": expected_max}]
    assert record["first_bad_module"] is None  # the forward itself was clean
    opt.step()
    assert amp_patch.last_step_skipped(opt)


def _inf_in(grad, kind):
    """``grad`` with one inf, stored as ``kind``: each layout a param's grad can arrive in."""
    if kind == "dense_transposed":  # (non-contiguous)
        grad = grad.t().contiguous().t()
        grad[0, 0] = float("inf")
        return grad
    grad = grad.coalesce()
    indices, values = grad._indices(), grad._values().clone()
    values.view(-1)[0] = float("inf")
    if kind == "sparse_uncoalesced":  # every entry stored twice, halves summing to the grad
        indices, values = torch.cat([indices, indices], 1), torch.cat([values / 2, values / 2])
    return torch.sparse_coo_tensor(indices, values, grad.shape, check_invariants=True)


@pytest.mark.parametrize("diagnose", [False, True])
@pytest.mark.parametrize("kind", ["dense_transposed", "sparse", "sparse_uncoalesced"])
def test_a_grad_with_inf_in_any_layout_skips_the_step_and_is_named(kind, diagnose):
    """Whatever layout the grad arrives in (nn.Embedding(sparse=True) gives sparse ones), the skip's cause names the
    param (naming a sparse grad's param raised NotImplementedError from isfinite, so the overflow crashed the step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(6, 3, sparse=kind != "dense_transposed"), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16,
                                      diagnose_overflow=diagnose, verbosity=0)
    model[0].weight.register_hook(lambda grad: _inf_in(grad, kind))
    before = model[0].weight.detach().clone()
    with amp_patch.scale_loss(model(torch.tensor([0, 2, 2, 5])).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp_patch.last_step_skipped(opt) and torch.equal(model[0].weight, before)
    record = amp_patch.history()[-1]
    assert record["cause_kind"] == "grads" and "0.weight" in record["cause"]


def test_history_records_steps_in_a_bounded_ring():
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp_patch.initialize(net, opt, history_size=3, growth_interval=100, max_loss_scale=2.0 ** 10,
                                    verbosity=0)
    for x in (0.5, float("inf"), 0.5, 0.5):
        with amp_patch.scale_loss(net(torch.full((1, 2), x)).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
    records = amp_patch.history()
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0] == {"step": 1, "loss_id": 0, "scale_before": 1024.0, "scale_after": 512.0,
                          "skipped": True, "overflow": None, "cause_kind": "loss",
                          "cause": "non-finite loss (inf/NaN in the forward pass, not a loss-scale problem)"}
    assert records[1]["cause"] is records[1]["cause_kind"] is None
    assert [r["skipped"] for r in records] == [True, False, False]



@pytest.mark.parametrize("closure", [False, True])
@pytest.mark.parametrize("bad", ["grads", "loss"])
def test_history_records_a_step_whose_delayed_grads_the_step_itself_unscaled(closure, bad):
    """A step whose only block delayed unscaling (the step unscales and checks the grads) is in the history as any
    other, skipped with its cause when its grads overflowed, and counts once."""
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp_patch.initialize(net, opt, max_loss_scale=2.0 ** 10, verbosity=0)

    def backward(broken):
        x = torch.full((1, 2), 1e30 if broken and bad == "loss" else 0.5)  # (1e30: inf in half, an inf loss)
        loss = _nan_grads_loss(net, x) if broken and bad == "grads" else net(x).float().sum()
        with amp_patch.scale_loss(loss, opt, delay_unscale=True) as scaled:
            scaled.backward()

    for broken in (False, True, False):
        opt.zero_grad()
        if closure:
            opt.step(lambda broken=broken: backward(broken))
        else:
            backward(broken)
            opt.step()
    records = amp_patch.history()
    assert [(r["step"], r["skipped"], r["scale_before"], r["scale_after"]) for r in records] == [
        (0, False, 1024.0, 1024.0), (1, True, 1024.0, 512.0), (2, False, 512.0, 512.0)]
    assert records[1]["cause_kind"] == bad


def _nan_grads_loss(net, x):
    """A finite loss whose grads are NaN (d/dv sqrt(v) at v = 0 is inf, times 0)."""
    out = net(x).float().sum()
    return out + torch.sqrt(out * 0)


def _session(**kwargs):
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return amp_patch.initialize(net, opt, verbosity=0, **kwargs)


def _step(net, opt, loss_fn=None, loss_id=0, step=True):
    x = torch.full((1, 2), 0.5)
    loss = loss_fn(net, x) if loss_fn else net(x).float().sum()
    with amp_patch.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
    if step:
        opt.step()
        opt.zero_grad()


def test_skips_at_the_scale_floor_are_not_warm_up():
    """Warm-up is a scaler backing off from its initial scale: at min_loss_scale it cannot, so the skips there are
    the gradients' (the doctor counts warm-up skips as healthy)."""
    net, opt = _session(min_loss_scale=128.0, max_loss_scale=256.0)
    for _ in range(3):
        _step(net, opt, _nan_grads_loss)
    assert [(r["scale_before"], r["scale_after"], r["cause_kind"]) for r in amp_patch.history()] == [
        (256.0, 128.0, "warmup"), (128.0, 128.0, "grads"), (128.0, 128.0, "grads")]


def test_a_loaded_scaler_that_completed_steps_is_past_its_warm_up_and_counts_on():
    net, opt = _session(max_loss_scale=1024.0)
    _step(net, opt)
    _step(net, opt)
    saved = amp_patch.state_dict()
    amp_patch.deinitialize()
    net, opt = _session(max_loss_scale=1024.0)
    amp_patch.load_state_dict(saved)
    _step(net, opt, _nan_grads_loss)
    assert [(r["step"], r["skipped"], r["cause_kind"]) for r in amp_patch.history()] == [(2, True, "grads")]


def test_an_update_rolled_back_by_zero_grad_leaves_the_history():
    """A block's exit updated the scaler, then zero_grad() dropped the step (no step() ran): the update is rolled
    back, and so is its record; the next update records that step number once."""
    net, opt = _session(growth_interval=1)
    state = amp_patch.state_dict()
    state["loss_scaler0"]["loss_scale"] = 256.0
    amp_patch.load_state_dict(state)
    _step(net, opt)
    _step(net, opt, step=False)
    opt.zero_grad()
    assert [(r["step"], r["scale_after"]) for r in amp_patch.history()] == [(0, 512.0)]
    _step(net, opt)
    assert [(r["step"], r["scale_before"], r["scale_after"]) for r in amp_patch.history()] == [
        (0, 256.0, 512.0), (1, 512.0, 1024.0)]



def test_loading_an_earlier_scaler_state_keeps_the_records_of_steps_that_ran():
    net, opt = _session()
    saved = amp_patch.state_dict()
    for _ in range(3):
        _step(net, opt)
    amp_patch.load_state_dict(saved)
    assert [r["step"] for r in amp_patch.history()] == [0, 1, 2]
    _step(net, opt)
    assert [r["step"] for r in amp_patch.history()] == [0, 1, 2, 0]

def test_each_loss_counts_its_own_steps():
    net, opt = _session(num_losses=2)
    for _ in range(2):
        _step(net, opt, loss_id=0, step=False)
        _step(net, opt, loss_id=1)
    assert [(r["loss_id"], r["step"]) for r in amp_patch.history()] == [(0, 0), (1, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize("last_delayed", [False, True])
def test_an_inf_loss_of_an_earlier_micro_batch_is_the_cause_of_the_skip(last_delayed):
    """Accumulating with delay_unscale: the micro-batch whose loss was inf is not the one whose exit unscales (or
    step() unscales); the skip's cause is still the loss."""
    net, opt = _session()
    x = torch.full((1, 2), 0.5)
    for micro, factor in enumerate((float("inf"), 1.0)):
        with amp_patch.scale_loss(net(x).float().sum() * factor, opt,
                                  delay_unscale=micro == 0 or last_delayed) as scaled:
            scaled.backward()
    opt.step()
    (record,) = amp_patch.history()
    assert record["skipped"] and record["cause_kind"] == "loss"


@pytest.mark.parametrize("zero_first", [False, True])
def test_an_update_stands_when_another_optimizer_of_its_loss_steps(zero_first):
    """One loss over two optimizers, only the first stepped (a frozen head zeroed every iteration): each update
    stands, whether the second's zero_grad() comes before or after the first's step (a rolled-back growth with
    kept back-offs would only ever lower the scale)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    o1 = torch.optim.SGD(model[0].parameters(), lr=0.01)
    o2 = torch.optim.SGD(model[1].parameters(), lr=0.01)
    model, (o1, o2) = amp_patch.initialize(model, [o1, o2], growth_interval=1, verbosity=0)
    state = amp_patch.state_dict()
    state["loss_scaler0"]["loss_scale"] = 4.0
    amp_patch.load_state_dict(state)
    for _ in range(3):
        with amp_patch.scale_loss(model(torch.full((1, 2), 0.5)).float().sum(), [o1, o2]) as scaled:
            scaled.backward()
        if zero_first:
            o2.zero_grad()
        o1.step()
        o1.zero_grad()
        o2.zero_grad()
    assert amp_patch.loss_scale() == 32.0
    assert [(r["step"], r["scale_after"]) for r in amp_patch.history()] == [(0, 8.0), (1, 16.0), (2, 32.0)]


def test_an_apex_checkpoints_unskipped_steps_end_the_warm_up():
    """An Apex checkpoint counts only the updates since its last overflow ('unskipped'): they ran."""
    net, opt = _session()
    amp_patch.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 37}})
    _step(net, opt, _nan_grads_loss)
    assert [(r["step"], r["cause_kind"]) for r in amp_patch.history()] == [(37, "grads")]


def test_apex_update_scale_after_deferred_checks_records_each_update():
    """The apex alias with delay_overflow_check: the script's update_scale() is the update, recorded with its skip."""
    from amp_patch.legacy import amp

    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    net, opt = amp.initialize(net, opt, opt_level="O1", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    for bad in (False, True):
        loss = net(torch.full((1, 2), 0.5)).float().sum() * (float("nan") if bad else 1e-3)
        with amp.scale_loss(loss, opt, delay_overflow_check=True) as scaled:
            scaled.backward()
        assert scaler.update_scale() is bad
        opt.step()
        opt.zero_grad()
    assert [(r["step"], r["skipped"], r["scale_before"], r["scale_after"]) for r in amp_patch.history()] == [
        (0, False, 65536.0, 65536.0), (1, True, 65536.0, 32768.0)]

def test_collapsing_scale_is_warned_once(caplog):
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp_patch.initialize(net, opt, verbosity=0)
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        for _ in range(20):  # 2**16 halves below 1 after 17 overflows
            with amp_patch.scale_loss(net(torch.full((1, 2), float("nan"))).float().sum(), opt) as scaled:
                scaled.backward()
            opt.step()
    collapse = [r for r in caplog.records if "collapsed" in r.getMessage()]
    assert len(collapse) == 1 and "diagnose_overflow=True" in collapse[0].getMessage()


class TinyTransformer(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.norm = torch.nn.LayerNorm(d)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x):
        h = self.norm(x)
        attn = F.softmax(self.q(h) @ self.k(h).transpose(-1, -2), dim=-1)
        return x + self.out(attn @ self.v(h))


def test_trace_of_one_iteration():
    model = TinyTransformer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Apex's list: the rows below name its float (softmax, layer_norm) and promote entries
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", op_lists="apex", verbosity=0)
    x = torch.randn(2, 3, 8)
    with amp_patch.trace() as t:
        loss = model(x).float().pow(2).mean()
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
    rows = t.report()
    by_op = {}
    for row in rows:
        agg = by_op.setdefault(row["qualname"], {"calls": 0, "misses": 0, "category": row["category"],
                                                 "out": set()})
        agg["calls"] += row["calls"]
        agg["misses"] += row["cache_misses"]
        agg["out"].update(row["output_dtypes"])
    assert by_op["torch.nn.functional.linear"] == {"calls": 4, "misses": 8, "category": "half", "out": {"float16"}}
    assert by_op["torch.nn.functional.softmax"]["calls"] == 1 and by_op["torch.nn.functional.softmax"]["out"] == {
        "float32"}
    assert by_op["torch.nn.functional.layer_norm"]["calls"] == 1
    assert by_op["torch.nn.functional.layer_norm"]["category"] == "float"
    distinct_half_weights = sum(p.numel() > 0 for m in (model.q, model.k, model.v, model.out)
                                for p in m.parameters())
    assert sum(row["cache_misses"] for row in rows) == distinct_half_weights == 8
    modules = {row["module"] for row in rows if row["qualname"] == "torch.nn.functional.linear"}
    assert modules == {"q", "k", "v", "out"}
    assert "torch.nn.functional.linear" in t.to_markdown() and '"rows"' in t.to_json()


def test_trace_counts_unpatched_calls_on_half_tensors():
    with amp_patch.autocast():
        with amp_patch.trace() as t:
            torch.relu(torch.mm(torch.randn(2, 2), torch.randn(2, 2)))
    assert {"qualname": "torch.relu", "calls_on_half": 1} in t.unpatched_report()


def test_trace_and_diagnosis_leave_nothing_behind():
    net = Net()
    before_wrappers = F.linear
    amp_patch.initialize(net, opt_level="O1", diagnose_overflow=True, verbosity=0)
    with amp_patch.trace():
        net(torch.randn(1, 4))
    assert getattr(F.linear, "_amp_patch_entry", None) is not None
    amp_patch.deinitialize()
    assert F.linear is before_wrappers
    assert all(not m._forward_hooks for m in net.modules())
    assert not torch.nn.modules.module._global_forward_hooks
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_trace_needs_casting():
    with pytest.raises(amp_patch.UsageError, match="needs O1 casting"):
        with amp_patch.trace():
            pass
