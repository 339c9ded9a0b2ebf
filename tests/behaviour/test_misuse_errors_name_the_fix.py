"""The mistakes new users make: each raises amp_patch's exception type whose message names the fix.

Every row is (id, action, exception type, regex of the fix the message must name). The action does the
mistake on fresh objects; the conftest fixture deinitializes after each row. No row may pass silently:
``pytest.raises`` fails a row that raises nothing.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from tests_support import compute_dtypes

import amp_patch
from amp_patch import ConfigError, OpListError, UsageError


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _init(level="O1", **kwargs):
    model = _net()
    model, opt = amp_patch.initialize(model, _sgd(model), opt_level=level, verbosity=0, **kwargs)
    return model, opt


def _lazy_init(level):
    model = torch.nn.Sequential(torch.nn.LazyLinear(4))
    return amp_patch.initialize(model, _sgd(model), opt_level=level, verbosity=0)


def _loss(model):
    x = torch.randn(3, 4)
    return F.mse_loss(model(x).float(), torch.zeros(3, 2))


def _scale(loss=None, optimizers=None, level="O1", **kwargs):
    model, opt = _init(level)
    loss = _loss(model) if loss is None else loss
    with amp_patch.scale_loss(loss, opt if optimizers is None else optimizers, **kwargs) as scaled:
        scaled.backward()


def _nested():
    model, opt = _init()
    with amp_patch.scale_loss(_loss(model), opt) as outer:
        with amp_patch.scale_loss(_loss(model), opt) as inner:
            inner.backward()
        outer.backward()


def _plain_backward_in_block(level):
    model, opt = _init(level)
    loss = _loss(model)
    with amp_patch.scale_loss(loss, opt):
        loss.backward()


def _two_optimizers():
    model = _net()
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model[2].parameters(), lr=0.1)
    model, (opt_a, opt_b) = amp_patch.initialize(model, [opt_a, opt_b], opt_level="O1", verbosity=0)
    return model, opt_a, opt_b


def _foreign_step():
    model, opt_a, opt_b = _two_optimizers()
    with amp_patch.scale_loss(_loss(model), opt_a) as scaled:
        scaled.backward()
    opt_b.step()


def _foreign_scale_loss():
    model, opt_a, opt_b = _two_optimizers()
    with amp_patch.scale_loss(_loss(model), opt_a) as scaled:
        scaled.backward()
    with amp_patch.scale_loss(_loss(model), opt_b) as scaled:
        scaled.backward()


def _other_weights(level):
    model, other = _net(), _net()
    amp_patch.initialize(model, _sgd(other), opt_level=level, verbosity=0)


def _op_list(tmp, text):
    path = tmp / "list.yaml"
    path.write_text(text)
    return lambda: amp_patch.load_op_lists(str(path))


def _in_region(fn):
    def run():
        with amp_patch.autocast():
            fn()
    return run


def _twice():
    _init()
    _init()


def _state_dict_mismatch():
    _init()
    amp_patch.load_state_dict({"loss_scaler0": {"loss_scale": 2.0}, "loss_scaler1": {"loss_scale": 2.0}})


def _register_after():
    _init()
    amp_patch.register_half_function(torch, "matmul")


ROWS = [
    # initialize: what is passed
    ("models_none", lambda: amp_patch.initialize(None, _sgd(_net())), ConfigError, r"pass the model"),
    ("o2_lazy_module", lambda: _lazy_init("O2"), UsageError, r"Run one forward pass first"),
    ("o3_lazy_module", lambda: _lazy_init("O3"), UsageError, r"Run one forward pass first"),
    ("opt_level_positional", lambda: amp_patch.initialize(_net(), _sgd(_net()), "O2"), ConfigError,
     r"opt_level='O2'"),
    ("enabled_string_false", lambda: amp_patch.initialize(_net(), enabled="False"), ConfigError, r"True or False"),
    ("opt_level_lowercase", lambda: amp_patch.initialize(_net(), opt_level="o2"), ConfigError, r"use 'O2'"),
    ("opt_level_digit_zero", lambda: amp_patch.initialize(_net(), opt_level="02"), ConfigError, r"capital letter O"),
    ("opt_level_unknown", lambda: amp_patch.initialize(_net(), opt_level="O4"), ConfigError, r"allowed: O0, O1"),
    ("initialize_twice", _twice, UsageError, r"deinitialize\(\) before"),
    ("wrapped_model", lambda: amp_patch.initialize(torch.nn.DataParallel(_net())), UsageError, r"then wrap it"),
    ("model_listed_twice", lambda: (lambda m: amp_patch.initialize([m, m]))(_net()), ConfigError, r"pass each once"),
    ("params_as_optimizer", lambda: amp_patch.initialize(_net(), list(_net().parameters())), ConfigError,
     r"torch\.optim\.(optimizer\.)?Optimizer"),
    ("o2_optimizer_over_other_model", lambda: _other_weights("O2"), ConfigError, r"model\.parameters\(\)"),
    ("o3_optimizer_over_other_model", lambda: _other_weights("O3"), ConfigError, r"pass that model too"),
    ("keep_fp32_module_names", lambda: amp_patch.initialize(_net(), opt_level="O2", keep_fp32_modules=("LayerNorm",)),
     ConfigError, r"e\.g\. torch\.nn\.LayerNorm"),
    ("keep_fp32_modules_string", lambda: amp_patch.initialize(_net(), opt_level="O2", keep_fp32_modules="LayerNorm"),
     ConfigError, r"keep_fp32_modules=\(torch\.nn\.LayerNorm,\)"),
    ("num_losses_zero", lambda: amp_patch.initialize(_net(), num_losses=0), ConfigError, r"positive integer"),
    ("history_size_zero", lambda: amp_patch.initialize(_net(), history_size=0), ConfigError, r"positive number"),
    ("loss_scale_typo", lambda: amp_patch.initialize(_net(), loss_scale="dynamc"), ConfigError,
     r"Did you mean loss_scale='dynamic'"),
    ("loss_scale_negative", lambda: amp_patch.initialize(_net(), loss_scale=-8.0), ConfigError, r"positive finite"),
    ("o1_cast_model_type", lambda: amp_patch.initialize(_net(), cast_model_type=torch.float16), ConfigError,
     r"use opt_level='O2' or 'O3'"),
    ("o1_master_weights", lambda: amp_patch.initialize(_net(), master_weights=True), ConfigError,
     r"use opt_level='O2'"),
    ("o1_keep_batchnorm", lambda: amp_patch.initialize(_net(), keep_batchnorm_fp32=True), ConfigError,
     r"leave keep_batchnorm_fp32=None"),
    ("o2_patch_functions", lambda: amp_patch.initialize(_net(), opt_level="O2", patch_torch_functions=True),
     ConfigError, r"use opt_level='O1'"),
    ("half_dtype_fp32", lambda: amp_patch.initialize(_net(), half_dtype=torch.float32), ConfigError,
     r"allowed: torch\.float16, torch\.bfloat16"),
    ("o2_op_lists", lambda: amp_patch.initialize(_net(), opt_level="O2", op_lists="apex"), ConfigError,
     r"Drop op_lists or use O1"),
    ("growth_backoff_swapped", lambda: amp_patch.initialize(_net(), growth_factor=0.5), ConfigError,
     r"swap growth_factor and backoff_factor"),
    ("initialize_inside_region", _in_region(lambda: amp_patch.initialize(_net())), UsageError, r"initialize first"),
    # scale_loss: what is passed
    ("scale_loss_before_initialize", lambda: amp_patch.scale_loss(torch.ones(()), _sgd(_net())).__enter__(),
     UsageError, r"call model, optimizer = amp_patch\.initialize"),
    ("loss_is_a_float", lambda: _scale(loss=1.5), UsageError, r"not loss\.item\(\)"),
    ("loss_not_scalar", lambda: _scale(loss=torch.ones(3, requires_grad=True) * 2), UsageError,
     r"scale_loss\(loss\.mean\(\), optimizer\)"),
    ("loss_integer", lambda: _scale(loss=torch.tensor(3)), UsageError, r"floating dtype"),
    ("loss_without_grad", lambda: _scale(loss=torch.tensor(0.5)), UsageError, r"with grad enabled"),
    ("loss_under_no_grad", lambda: (lambda m: _scale_no_grad(m))(None), UsageError, r"with grad enabled"),
    ("no_optimizers", lambda: _scale(optimizers=[]), UsageError, r"scale_loss\(loss, optimizer\)"),
    ("optimizer_is_a_model", lambda: _scale(optimizers=_net()), ConfigError, r"an optimizer or a list"),
    ("optimizer_not_initialized", lambda: _scale(optimizers=_sgd(_net())), UsageError,
     r"initialize\(model, \[opt1, opt2\]"),
    ("loss_id_out_of_range", lambda: _scale(loss_id=1), UsageError, r"pass num_losses=2"),
    ("loss_id_bool", lambda: _scale(loss_id=True), UsageError, r"use an existing loss id"),
    ("nested_same_optimizer", _nested, UsageError, r"scale_loss\(loss1 \+ loss2, optimizer\)"),
    ("loss_backward_in_block_o1", lambda: _plain_backward_in_block("O1"), UsageError, r"call scaled_loss\.backward"),
    ("loss_backward_in_block_o2", lambda: _plain_backward_in_block("O2"), UsageError, r"call scaled_loss\.backward"),
    ("optimizer_not_passed_then_step", _foreign_step, UsageError, r"scale_loss\(loss, \[opt1, opt2\]\)"),
    ("optimizer_not_passed_then_its_loss", _foreign_scale_loss, UsageError, r"optimizer\.zero_grad\(\)"),
    # the other entry points
    ("master_params_before_initialize", lambda: amp_patch.master_params(_sgd(_net())), UsageError,
     r"amp_patch\.initialize\(model, optimizer"),
    ("loss_scale_bad_id", lambda: (_init(), amp_patch.loss_scale(3)), UsageError, r"pass num_losses=4"),
    ("last_step_skipped_unknown_optimizer", lambda: (_init(), amp_patch.last_step_skipped(_sgd(_net()))),
     UsageError, r"pass every optimizer"),
    ("state_dict_wrong_key", lambda: (_init(), amp_patch.load_state_dict({"scale": 1.0})), ConfigError,
     r"expected keys 'loss_scaler0'"),
    ("state_dict_two_losses", _state_dict_mismatch, ConfigError, r"pass num_losses=2 to initialize"),
    ("register_after_initialize", _register_after, UsageError, r"move the registration above initialize"),
    ("register_missing_name", lambda: amp_patch.register_half_function(torch, "matmull"), ConfigError,
     r"its exact name"),
    ("autocast_fp32", lambda: amp_patch.autocast(half_dtype=torch.float32), ConfigError,
     r"allowed: torch\.float16, torch\.bfloat16"),
    ("unknown_shipped_list", lambda: amp_patch.load_op_lists("apexx"), ConfigError, r"pass a path to a YAML file"),
]


def _scale_no_grad(_):
    model, opt = _init()
    with torch.no_grad():
        loss = _loss(model)
    with amp_patch.scale_loss(loss, opt) as scaled:
        scaled.backward()


TMP_ROWS = [  # rows that need a file
    ("op_list_torch_save", "half:\n  torch: [save]\n", OpListError, r"not a tensor op"),
    ("op_list_manual_seed", "float:\n  torch: [manual_seed]\n", OpListError, r"list tensor ops such as"),
    ("op_list_unimported_module", "half:\n  torch.utils.bottleneck: [main]\n", OpListError,
     r"import it before"),
]


def test_the_table_is_large():
    assert len(ROWS) + len(TMP_ROWS) >= 40


@pytest.mark.parametrize("case_id,action,exc,fix", ROWS, ids=[r[0] for r in ROWS])
def test_misuse_raises_and_names_the_fix(case_id, action, exc, fix):
    with pytest.raises(exc) as info:
        action()
    assert re.search(fix, str(info.value)), f"{case_id}: message does not name the fix: {info.value}"


@pytest.mark.parametrize("case_id,text,exc,fix", TMP_ROWS, ids=[r[0] for r in TMP_ROWS])
def test_op_list_misuse(tmp_path, case_id, text, exc, fix):
    with pytest.raises(exc) as info:
        _op_list(tmp_path, text)()
    assert re.search(fix, str(info.value)), f"{case_id}: message does not name the fix: {info.value}"


def test_keep_fp32_modules_accepts_one_class():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    amp_patch.initialize(model, opt_level="O2", keep_fp32_modules=torch.nn.LayerNorm, verbosity=0)
    dtypes = compute_dtypes(model, torch.randn(2, 4))
    assert dtypes["1.weight"] is torch.float32 and dtypes["0.weight"] is torch.float16


def test_disabled_session_calls_are_no_ops():
    model = _net()
    opt = _sgd(model)
    amp_patch.initialize(model, opt, enabled=False)
    loss = _loss(model)
    with amp_patch.scale_loss(loss, opt) as scaled:
        assert scaled is loss
        scaled.backward()
    opt.step()
    assert amp_patch.last_step_skipped(opt) is False
    assert amp_patch.last_overflow() is None and amp_patch.history() == []
    assert amp_patch.loss_scale() == 1.0 and amp_patch.state_dict() == {}


def test_deinitialize_inside_a_region_keeps_the_region_working():
    with amp_patch.autocast():
        amp_patch.deinitialize()  # no session: must not drop the region's engine
        a = torch.randn(2, 2)
        assert torch.mm(a, a).dtype is torch.float16
        with amp_patch.disable_casts():
            assert torch.mm(a, a).dtype is torch.float32


def test_one_block_for_two_optimizers_steps_both():
    model, opt_a, opt_b = _two_optimizers()
    with amp_patch.scale_loss(_loss(model), [opt_a, opt_b]) as outer:
        outer.backward()
    opt_a.step()
    opt_b.step()
    assert not amp_patch.last_step_skipped(opt_a)


def test_a_foreign_grad_cleared_by_zero_grad_is_accepted():
    model, opt_a, opt_b = _two_optimizers()
    with amp_patch.scale_loss(_loss(model), opt_a) as scaled:
        scaled.backward()
    opt_b.zero_grad()
    opt_b.step()  # nothing scaled is left: no error
    model.zero_grad()
    with amp_patch.scale_loss(_loss(model), [opt_a, opt_b]) as scaled:
        scaled.backward()
    opt_b.step()


def test_blocks_on_different_optimizers_may_nest():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 2), "b": torch.nn.Linear(4, 2)})
    opt_a = torch.optim.SGD(model["a"].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model["b"].parameters(), lr=0.1)
    model, (opt_a, opt_b) = amp_patch.initialize(model, [opt_a, opt_b], num_losses=2, verbosity=0)
    x = torch.randn(3, 4)
    with amp_patch.scale_loss(model["a"](x).float().pow(2).mean(), opt_a, loss_id=0) as outer:
        with amp_patch.scale_loss(model["b"](x).float().pow(2).mean(), opt_b, loss_id=1) as inner:
            inner.backward()
        outer.backward()
    opt_a.step()
    opt_b.step()  # the inner block unscaled b's grads: nothing foreign is left
    assert not amp_patch.last_step_skipped(opt_a) and not amp_patch.last_step_skipped(opt_b)
