"""apex.optimizers (amp_patch.legacy.apex.optimizers) against references written from Apex's published formulas.

Each reference below is a plain per-parameter loop over the update rule as Apex's kernels documented it
(csrc/multi_tensor_{adam,sgd_kernel,lamb,novograd,adagrad}.cu), written independently of the foreach code.
The optimizers get the same synthetic gradients as the reference, so only the update math is compared:
20 steps, fp32, max relative difference <= 1e-6 per tensor.
"""
import copy
import logging
import math

import pytest
import torch

import amp_patch
from amp_patch.errors import ConfigError
from amp_patch.legacy.apex.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

STEPS = 20
TOL = 1e-6


# -- references (per parameter, from the formulas) -------------------------------------------------------
def _bc(beta, t, on):
    return 1.0 - beta ** t if on else 1.0


def ref_adam(p, g, st, t, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True,
             bias_correction=True, **_):
    b1, b2 = betas
    if not adam_w_mode:
        g = g + weight_decay * p
    st["m"] = b1 * st.get("m", torch.zeros_like(p)) + (1 - b1) * g
    st["v"] = b2 * st.get("v", torch.zeros_like(p)) + (1 - b2) * g * g
    upd = (st["m"] / _bc(b1, t, bias_correction)) / ((st["v"] / _bc(b2, t, bias_correction)).sqrt() + eps)
    if adam_w_mode:
        upd = upd + weight_decay * p
    return p - lr * upd


def ref_sgd(p, g, st, t, lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
            wd_after_momentum=False, **_):
    if weight_decay and not wd_after_momentum:
        g = g + weight_decay * p
    if momentum:
        st["buf"] = g.clone() if "buf" not in st else momentum * st["buf"] + (1 - dampening) * g
        g = g + momentum * st["buf"] if nesterov else st["buf"]
    if weight_decay and wd_after_momentum:
        g = g + weight_decay * p
    return p - lr * g


def ref_adagrad(p, g, st, t, lr=1e-2, eps=1e-10, weight_decay=0.0, adagrad_w_mode=False, **_):
    if not adagrad_w_mode:
        g = g + weight_decay * p
    st["h"] = st.get("h", torch.zeros_like(p)) + g * g
    upd = g / (st["h"].sqrt() + eps)
    if adagrad_w_mode:
        upd = upd + weight_decay * p
    return p - lr * upd


def ref_novograd(p, g, st, t, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, reg_inside_moment=False,
                 grad_averaging=True, norm_type=2, init_zero=False, bias_correction=True, **_):
    b1, b2 = betas
    n = g.norm() if norm_type == 2 else g.abs().max()
    if "v" not in st:
        st["v"] = torch.zeros(()) if init_zero else n
    st["v"] = (b2 * st["v"] ** 2 + (1 - b2) * n ** 2).sqrt() if norm_type == 2 else b2 * st["v"] + (1 - b2) * n
    bc1 = _bc(b1, t, bias_correction)
    bc2 = math.sqrt(_bc(b2, t, bias_correction))
    beta3 = 1 - b1 if grad_averaging else 1.0
    denom = st["v"] / bc2 + eps
    m = st.get("m", torch.zeros_like(p))
    if reg_inside_moment:
        st["m"] = b1 * m + beta3 * (g / denom + weight_decay * p)
        return p - lr * st["m"] / bc1
    st["m"] = b1 * m + beta3 * g
    return p - lr * ((st["m"] / bc1) / denom + weight_decay * p)


def ref_lamb(params, grads, states, t, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, adam_w_mode=True,
             grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False, bias_correction=True, **_):
    """LAMB needs every grad (the global norm), so this reference takes the whole list."""
    b1, b2 = betas
    gnorm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    clip = gnorm / max_grad_norm if gnorm > max_grad_norm else 1.0
    beta3 = 1 - b1 if grad_averaging else 1.0
    out = []
    for p, g, st in zip(params, grads, states):
        sg = g / clip
        if not adam_w_mode:
            sg = sg + weight_decay * p
        st["m"] = b1 * st.get("m", torch.zeros_like(p)) + beta3 * sg
        st["v"] = b2 * st.get("v", torch.zeros_like(p)) + (1 - b2) * sg * sg
        upd = (st["m"] / _bc(b1, t, bias_correction)) / ((st["v"] / _bc(b2, t, bias_correction)).sqrt() + eps)
        if adam_w_mode:
            upd = upd + weight_decay * p
        ratio = lr
        if use_nvlamb or weight_decay != 0:
            pn, un = float(p.norm()), float(upd.norm())
            ratio = lr * pn / un if pn != 0 and un != 0 else lr
        out.append(p - ratio * upd)
    return out


def _per_param(rule):
    def run(params, grads, states, t, **kw):
        return [rule(p, g, st, t, **kw) for p, g, st in zip(params, grads, states)]
    return run


REFERENCES = {FusedAdam: _per_param(ref_adam), FusedSGD: _per_param(ref_sgd), FusedAdagrad: _per_param(ref_adagrad),
              FusedNovoGrad: _per_param(ref_novograd), FusedLAMB: ref_lamb}

CASES = [
    (FusedAdam, {}),
    (FusedAdam, dict(lr=1e-2, weight_decay=0.1)),
    (FusedAdam, dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False, bias_correction=False)),
    (FusedSGD, dict(lr=0.05)),
    (FusedSGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (FusedSGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, wd_after_momentum=True)),
    (FusedLAMB, {}),
    (FusedLAMB, dict(lr=1e-2, adam_w_mode=False, grad_averaging=False, max_grad_norm=100.0)),
    (FusedLAMB, dict(lr=1e-2, weight_decay=0.0, use_nvlamb=True, bias_correction=False)),
    (FusedLAMB, dict(lr=1e-2, weight_decay=0.0)),
    (FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01)),
    (FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01, reg_inside_moment=True, norm_type=0, grad_averaging=False)),
    (FusedNovoGrad, dict(lr=1e-2, init_zero=True, bias_correction=False)),
    (FusedAdagrad, dict(weight_decay=0.01)),
    (FusedAdagrad, dict(weight_decay=0.01, adagrad_w_mode=True)),
]


def _ids(case):
    cls, kw = case
    return cls.__name__ + "-" + "-".join(f"{k}={v}" for k, v in kw.items())


def _shapes():
    return [(6, 5), (6,), (3, 6), (3,)]


def _grad_stream(seed, steps=STEPS):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in _shapes()] for _ in range(steps)]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_twenty_steps_match_the_published_formulas(case):
    cls, kw = case
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in _shapes()]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = cls(params, **kw)
    ref, states = [t.clone() for t in init], [{} for _ in init]
    for t, grads in enumerate(_grad_stream(1), start=1):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref = REFERENCES[cls](ref, grads, states, t, **kw)
    worst = max(_rel(p.detach(), r) for p, r in zip(params, ref))
    moved = max(_rel(p.detach(), i) for p, i in zip(params, init))
    assert worst <= TOL, f"{cls.__name__}{kw}: max relative difference {worst:.3g} > {TOL}"
    assert moved > 1e-4, "the parameters did not move: the comparison proves nothing"


def test_param_groups_keep_their_own_settings():
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(4, generator=gen)) for _ in range(2))
    start = [a.detach().clone(), b.detach().clone()]
    opt = FusedAdam([{"params": [a]}, {"params": [b], "lr": 1e-1, "weight_decay": 0.5}], lr=1e-3)
    ref_a, ref_b, sa, sb = start[0], start[1], {}, {}
    for t in range(1, 4):
        g = torch.randn(4, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_a = ref_adam(ref_a, g, sa, t, lr=1e-3)
        ref_b = ref_adam(ref_b, g, sb, t, lr=1e-1, weight_decay=0.5)
    assert _rel(a.detach(), ref_a) <= TOL and _rel(b.detach(), ref_b) <= TOL
    assert [g["step"] for g in opt.param_groups] == [3, 3]


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedNovoGrad])
def test_amsgrad_is_refused_as_apex_did(cls):
    with pytest.raises(ConfigError, match="AMSGrad"):
        cls([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)


def test_kernel_tuning_arguments_are_accepted_with_one_info_line(caplog):
    with caplog.at_level(logging.INFO, logger="amp_patch"):
        FusedAdam([torch.nn.Parameter(torch.zeros(2))], capturable=True)
    assert [r.getMessage() for r in caplog.records] == [
        "FusedAdam: capturable=True accepted with no effect (they tuned Apex's CUDA kernels; the foreach math here "
        "gives the same results)"]


def test_argument_checks_name_the_fix():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ConfigError, match="max_grad_norm=float"):
        FusedLAMB(p, max_grad_norm=0.0)
    with pytest.raises(ConfigError, match="Nesterov"):
        FusedSGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ConfigError, match="norm_type"):
        FusedNovoGrad(p, norm_type=1)
    with pytest.raises(RuntimeError, match="no arguments"):
        FusedAdam(p).step(scale=2.0)


@pytest.mark.parametrize("cls,default_none", [(FusedAdam, True), (FusedSGD, False), (FusedLAMB, True),
                                              (FusedNovoGrad, True), (FusedAdagrad, True)])
def test_zero_grad_follows_set_grad_none(cls, default_none):
    p = torch.nn.Parameter(torch.ones(2))
    opt = cls([p], lr=0.1)
    p.grad = torch.ones(2)
    opt.zero_grad()
    assert (p.grad is None) == default_none
    if not default_none:
        assert torch.equal(p.grad, torch.zeros(2))
    p.grad = torch.ones(2)
    cls([p], lr=0.1, set_grad_none=not default_none).zero_grad()
    assert (p.grad is None) == (not default_none)


STATE_KEYS = {FusedAdam: {"exp_avg", "exp_avg_sq"}, FusedLAMB: {"exp_avg", "exp_avg_sq"},
              FusedSGD: {"momentum_buffer"}, FusedNovoGrad: {"exp_avg"}, FusedAdagrad: {"sum"}}


@pytest.mark.parametrize("cls", list(STATE_KEYS))
def test_state_dict_round_trip_continues_bit_for_bit(cls):
    kw = dict(lr=0.05, momentum=0.9) if cls is FusedSGD else dict(lr=1e-2)
    grads = _grad_stream(2, steps=8)
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in _shapes()]
    opt = cls(params, **kw)

    def run(opt, params, stream):
        for gs in stream:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()

    run(opt, params, grads[:4])
    saved = copy.deepcopy(opt.state_dict())  # (state_dict() holds the live state tensors)
    assert set(saved["state"][0]) == STATE_KEYS[cls]
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = cls(clone, **kw)
    other.load_state_dict(saved)
    run(opt, params, grads[4:])
    run(other, clone, grads[4:])
    assert all(torch.equal(a, b) for a, b in zip(params, clone))


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


O2_CASES = [(FusedAdam, dict(lr=1e-2, weight_decay=0.01)), (FusedSGD, dict(lr=0.05, momentum=0.9)),
            (FusedLAMB, dict(lr=1e-2)), (FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01)),
            (FusedAdagrad, dict(lr=1e-2))]


BF16, FP16 = torch.bfloat16, torch.float16
LEVEL_CASES = ([(case, "O2", BF16) for case in O2_CASES] + [(case, "O2", FP16) for case in O2_CASES[:3]]
               + [(O2_CASES[0], "O1", BF16), (O2_CASES[2], "O1", BF16)])


@pytest.mark.parametrize("case,opt_level,half", LEVEL_CASES,
                         ids=[f"{c[0].__name__}-{lvl}-{str(h)[6:]}" for c, lvl, h in LEVEL_CASES])
def test_under_initialize_they_update_the_fp32_params_by_the_formulas(case, opt_level, half):
    """O2's fp32 params are the masters (amp_patch's own API; the apex alias keeps Apex's two-copy layout, see
    test_apex_*): each step must apply the reference rule to their (unscaled) grads, and the forward runs on them
    rounded to half. O1 keeps the fp32 model params in the optimizer.
    (fp16: a static scale of 128, so no step is skipped and every recorded grad was applied.)"""
    cls, kw = case
    torch.manual_seed(0)
    model = _Tiny()
    start = [p.detach().clone() for p in model.parameters()]
    scale = {"loss_scale": 128.0} if half is FP16 else {}
    model, opt = amp_patch.initialize(model, cls(model.parameters(), **kw), opt_level=opt_level,
                                      half_dtype=half, verbosity=0, **scale)
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([m.grad.clone() for m in masters]))
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    ref, states = start, [{} for _ in start]
    for t, grads in enumerate(seen, start=1):
        ref = REFERENCES[cls](ref, grads, states, t, **kw)
    assert max(_rel(m.detach(), r) for m, r in zip(masters, ref)) <= TOL
    model_params = list(model.parameters())
    if opt_level == "O2":
        assert all(p is m for p, m in zip(model_params, masters))  # one owner
        assert set(v.dtype for s in opt.state.values() for v in s.values() if torch.is_tensor(v)) == {torch.float32}
    assert losses[-1] < losses[0]


def test_a_skipped_step_leaves_step_count_and_state_alone():
    torch.manual_seed(0)
    model = _Tiny()
    model, opt = amp_patch.initialize(model, FusedAdam(model.parameters(), lr=1e-2), opt_level="O2",
                                      half_dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(4, 6)
    for poison in (False, True):
        loss = model(x).float().sum() * (float("inf") if poison else 1.0)
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        before = {k: v.clone() for k, v in opt.state[opt.param_groups[0]["params"][0]].items()}
        opt.step()
        opt.zero_grad()
    assert amp_patch.last_step_skipped(opt)
    assert opt.param_groups[0]["step"] == 1
    after = opt.state[opt.param_groups[0]["params"][0]]
    assert all(torch.equal(before[k], after[k]) for k in before)
