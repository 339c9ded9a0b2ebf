"""initialize(): Apex's opt-level defaults and override rules, return structure, misuse errors."""
import warnings

import pytest
import torch
from tests_support import compute_dtypes

import amp_patch
from amp_patch import ConfigError, UsageError


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def _opt(model, cls=torch.optim.SGD):
    return cls(model.parameters(), lr=0.1)


@pytest.mark.parametrize("level,param_dtypes,compute,bn_dtype,out_dtype,scale", [
    ("O0", {torch.float32}, {torch.float32}, torch.float32, torch.float32, 1.0),
    ("O1", {torch.float32}, {torch.float32}, torch.float32, torch.float16, 65536.0),
    ("O2", {torch.float32}, {torch.float16, torch.float32}, torch.float32, torch.float32, 65536.0),
    ("O3", {torch.float16}, {torch.float16}, torch.float16, torch.float32, 1.0),
])
def test_opt_level_documented_behaviour(level, param_dtypes, compute, bn_dtype, out_dtype, scale):
    model = _model()
    opt = _opt(model)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
    assert {p.dtype for p in model.parameters()} == param_dtypes  # O2: the fp32 params are the masters
    assert set(compute_dtypes(model, torch.randn(3, 4)).values()) == compute  # O2: half copies, bn kept fp32
    assert model[1].weight.dtype is bn_dtype and model[1].running_mean.dtype is bn_dtype
    assert model(torch.randn(3, 4)).dtype is out_dtype
    assert amp_patch.loss_scale() == scale
    masters = list(amp_patch.master_params(opt))
    assert all(p.dtype is torch.float32 for p in masters) == (level != "O3")
    if level == "O2":  # one owner: the optimizer holds the model's own params
        assert [id(p) for p in masters] == [id(p) for p in model.parameters()]
    amp_patch.deinitialize()
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_returns_the_structure_it_was_given():
    m1, m2 = _model(), _model()
    o1 = _opt(m1)
    assert amp_patch.initialize(m1, verbosity=0) is m1
    amp_patch.deinitialize()
    models, opts = amp_patch.initialize([m1, m2], [o1], verbosity=0)
    assert isinstance(models, list) and models[0] is m1 and isinstance(opts, list) and opts[0] is o1
    amp_patch.deinitialize()
    model, opt = amp_patch.initialize(m1, o1, verbosity=0)
    assert model is m1 and opt is o1 and isinstance(opt, torch.optim.SGD)


@pytest.mark.parametrize("kwargs,match", [
    (dict(opt_level="O1", master_weights=True), "master_weights"),
    (dict(opt_level="O1", keep_batchnorm_fp32=True), "keep_batchnorm_fp32"),
    (dict(opt_level="O1", cast_model_type=torch.float16), "cast_model_type.*O2"),
    (dict(opt_level="O2", patch_torch_functions=True), "patch_torch_functions.*O1"),
    (dict(opt_level="O3", patch_torch_functions=True), "patch_torch_functions"),
    (dict(opt_level="01"), "digit zero.*\"O1\""),
    (dict(opt_level="o2"), "case-sensitive.*'O2'"),
    (dict(opt_level="O4"), "allowed: O0, O1, O2, O3"),
    (dict(loss_scale="dyanmic"), "dynamic"),
    (dict(loss_scale=-1), "positive"),
    (dict(keep_batchnorm_fp32="yes", opt_level="O2"), "True"),
    (dict(half_dtype=torch.float64), "half_dtype"),
    (dict(num_losses=0), "num_losses"),
    (dict(opt_level="O2", op_lists="apex"), "op_lists only apply"),
    (dict(op_lists="apx"), "no shipped op list.*apex"),
    (dict(keep_fp32_modules=[int]), "nn.Module subclasses"),
])
def test_rejected_configurations_say_why(kwargs, match):
    model = _model()
    with pytest.raises(ConfigError, match=match):
        amp_patch.initialize(model, _opt(model), **{"verbosity": 0, **kwargs})
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_accepted_string_overrides():
    model = _model()
    amp_patch.initialize(model, _opt(model), opt_level="O2", keep_batchnorm_fp32="False", loss_scale="128.0",
                         verbosity=0)
    assert compute_dtypes(model, torch.randn(3, 4))["1.weight"] is torch.float16 and amp_patch.loss_scale() == 128.0


def test_bfloat16_defaults_to_no_scaling_but_still_skips():
    model = torch.nn.Linear(2, 1)
    opt = _opt(model)
    amp_patch.initialize(model, opt, half_dtype=torch.bfloat16, verbosity=0)
    assert amp_patch.loss_scale() == 1.0
    before = model.weight.detach().clone()
    loss = model(torch.tensor([[float("inf"), 1.0]])).float().sum()
    with amp_patch.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp_patch.last_step_skipped(opt) and torch.equal(model.weight, before)


def test_enabled_false_is_a_no_op_everywhere():
    model = _model()
    opt = _opt(model)
    assert amp_patch.initialize(model, opt, enabled=False) == (model, opt)
    out = model(torch.randn(3, 4))
    assert out.dtype is torch.float32
    loss = out.sum()
    with amp_patch.scale_loss(loss, opt) as scaled:
        assert scaled is loss
        scaled.backward()
    assert amp_patch.state_dict() == {} and amp_patch.loss_scale() == 1.0


def test_misuse_errors():
    model = _model()
    opt = _opt(model)
    loss = torch.ones((), requires_grad=True)
    with pytest.raises(UsageError, match="before amp_patch.initialize"):
        with amp_patch.scale_loss(loss, opt):
            pass
    with pytest.raises(UsageError, match="wrap it: model = DataParallel"):
        amp_patch.initialize(torch.nn.DataParallel(model), verbosity=0)
    amp_patch.initialize(model, opt, verbosity=0)
    with pytest.raises(UsageError, match="already called.*deinitialize"):
        amp_patch.initialize(model, opt, verbosity=0)
    with pytest.raises(UsageError, match="loss_id=1.*num_losses=2"):
        with amp_patch.scale_loss(loss, opt, loss_id=1):
            pass
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1)
    with pytest.raises(UsageError, match="was not passed to amp_patch.initialize"):
        with amp_patch.scale_loss(loss, other):
            pass
    with pytest.raises(ConfigError, match="must be a torch.nn.modules.module.Module"):
        amp_patch.deinitialize()
        amp_patch.initialize("model")


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("scheduler_first", [True, False])
def test_lr_scheduler_no_spurious_warning_even_after_a_skipped_step(level, scheduler_first):
    model = torch.nn.Linear(2, 1)
    opt = _opt(model)
    if scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
    if not scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in (float("inf"), 1.0):  # the first step overflows and is skipped
            loss = model(torch.tensor([[x, 1.0]])).float().sum()
            opt.zero_grad()
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_optimizer_state_dict_round_trip(level):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, loss_scale=128.0, verbosity=0)
    loss = model(torch.randn(4, 3)).float().pow(2).sum()
    with amp_patch.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert not amp_patch.last_step_skipped(opt)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"} and sd["state"][0]["exp_avg"].dtype is torch.float32
    fresh = torch.optim.Adam(model.parameters(), lr=1e-3)
    fresh.load_state_dict(sd)
    opt.load_state_dict(sd)
    assert torch.equal(opt.state_dict()["state"][1]["exp_avg_sq"], sd["state"][1]["exp_avg_sq"])


def test_import_does_nothing(tmp_path):
    import subprocess
    import sys

    code = ("import sys, torch; before = dict(vars(torch.nn.functional)); import amp_patch; "
            "assert dict(vars(torch.nn.functional)) == before; "
            "assert not [m for m in sys.modules if m.startswith('yaml')], 'yaml imported'; "
            "assert amp_patch.session.state.current() is None")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


def test_o2_keep_fp32_modules_and_cast_model_outputs():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.norm = torch.nn.LayerNorm(4)
            self.out = torch.nn.Linear(4, 2)

        def forward(self, x):
            h = self.norm(self.fc(x))
            seen.append(h.dtype)
            return self.out(h)

    seen = []
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", keep_fp32_modules=(torch.nn.LayerNorm,),
                                      cast_model_outputs=torch.float16, verbosity=0)
    dtypes = compute_dtypes(model, torch.randn(3, 4))
    seen.clear()
    assert dtypes["norm.weight"] is torch.float32 and dtypes["fc.weight"] is torch.float16
    assert model(torch.randn(3, 4)).dtype is torch.float16
    assert seen == [torch.float16]  # back to half after the fp32 module, for the half layers after it
    amp_patch.deinitialize()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not model._state_dict_hooks and not model._load_state_dict_pre_hooks
    assert model(torch.randn(3, 4)).dtype is torch.float32


def test_initialize_inside_an_autocast_region_is_refused():
    with amp_patch.autocast():
        with pytest.raises(UsageError, match="inside an open amp_patch.autocast"):
            amp_patch.initialize(_model(), verbosity=0)


def test_skipped_version_dependent_entries_are_reported(caplog):
    import logging

    spec = ["apex", {"add": {"half": {"torch": [{"name": "future_op", "min_torch": "99.0"}]}}}]
    with caplog.at_level(logging.INFO, logger="amp_patch"):
        amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", op_lists=spec, verbosity=0)
    assert "1 op-list entry skipped" in caplog.text and "torch.future_op" in caplog.text
    assert "needs torch >= 99.0" in caplog.text


class _Block(torch.nn.Module):
    """A composite module a user keeps fp32: children of its own (an attention with its out_proj, a Sequential)."""

    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 8)))

    def forward(self, h):
        return self.mlp(self.attention(h, h, h)[0])


@pytest.mark.parametrize("kept", [torch.nn.MultiheadAttention, torch.nn.Sequential, _Block])
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_kept_fp32_module_runs_fp32_with_every_module_inside_it(level, kept):
    """The kept module's inputs were cast to fp32 while the modules inside it ran in half (a raw dtype error)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _Block(), torch.nn.Linear(8, 3))
    opt = _opt(model)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0,
                                      keep_fp32_modules=(kept,))
    try:
        dtypes = compute_dtypes(model, torch.randn(2, 5, 8))
        kept_inside = {param for name, module in model.named_modules() if isinstance(module, kept)
                       for param, _ in module.named_parameters(prefix=name, remove_duplicate=False)}
        loss = model(torch.randn(2, 5, 8)).float().sum()
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    finally:
        amp_patch.deinitialize()
    assert kept_inside
    for name, dtype in dtypes.items():
        assert dtype == (torch.float32 if name in kept_inside else torch.bfloat16), (name, dtype)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_keeping_the_type_of_an_attentions_out_proj_without_the_attention_is_refused_naming_the_fix(level):
    """``keep_fp32_modules=(nn.Linear,)`` matched ``MultiheadAttention.out_proj``, which the attention reads without
    calling it: a raw dtype error at the first forward. Refused at initialize, before anything changes."""
    model = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    with pytest.raises(ConfigError, match=r"'self_attn.out_proj'.*add torch.nn.MultiheadAttention"):
        amp_patch.initialize(model, _opt(model), opt_level=level, half_dtype=torch.bfloat16, verbosity=0,
                             keep_fp32_modules=(torch.nn.Linear,))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model, _ = amp_patch.initialize(model, _opt(model), opt_level=level, half_dtype=torch.bfloat16, verbosity=0,
                                    keep_fp32_modules=(torch.nn.Linear, torch.nn.MultiheadAttention))
    try:
        model(torch.randn(2, 3, 8))
    finally:
        amp_patch.deinitialize()
