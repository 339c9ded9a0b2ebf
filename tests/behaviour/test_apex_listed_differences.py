"""Small parts of Apex's surface scripts can depend on, as Apex had them: ``apex.deprecated_warning``,
``apex.parallel.optimized_sync_batchnorm``, ``DynamicLossScaler._has_inf_or_nan``, ``opt_properties.master_weights``
unset (None) at O1, and ``amp.load_state_dict`` loading the loss scalers before it raises for unexpected keys."""
import warnings

import pytest
import torch

import amp_patch
from amp_patch import legacy
from amp_patch.legacy import amp
from amp_patch.legacy.amp_state import AMP_STATE


@pytest.fixture
def alias():
    handle = legacy.install_apex_alias()
    yield
    handle.uninstall()


def test_deprecated_warning_issues_apex_s_warning_class(alias):
    import apex
    from apex import deprecated_warning

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        deprecated_warning("apex.X is deprecated")
    (warning,) = seen
    assert warning.category is apex.DeprecatedFeatureWarning and str(warning.message) == "apex.X is deprecated"
    assert issubclass(apex.DeprecatedFeatureWarning, FutureWarning)


def test_optimized_sync_batchnorm_is_apex_parallel_s_sync_batchnorm(alias):
    import apex.parallel
    from apex.parallel.optimized_sync_batchnorm import SyncBatchNorm

    assert SyncBatchNorm is apex.parallel.SyncBatchNorm
    bn = SyncBatchNorm(3, channel_last=True, fuse_relu=False)
    assert bn(torch.randn(4, 3)).shape == (4, 3)


def test_dynamic_loss_scaler_has_inf_or_nan_as_scripts_call_it(alias):
    from apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler

    assert DynamicLossScaler._has_inf_or_nan(torch.tensor([1.0, float("inf")]).half())
    assert DynamicLossScaler._has_inf_or_nan(torch.tensor([float("nan"), 2.0]))
    assert not DynamicLossScaler._has_inf_or_nan(torch.tensor([1.0, -3.0]).half())
    assert not DynamicLossScaler()._has_inf_or_nan(torch.tensor([1.0]))  # (on an instance too)
    assert not LossScaler._has_inf_or_nan(torch.tensor([float("inf")]))  # (the static scaler never reports one)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([0.0, float("inf")])
    assert DynamicLossScaler().has_overflow([p])


@pytest.mark.parametrize("level,expected", [("O0", False), ("O1", None), ("O2", True), ("O3", False)])
def test_opt_properties_master_weights_reads_as_apex_s(level, expected):
    model = torch.nn.Linear(2, 2)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
    assert AMP_STATE.opt_properties.master_weights is expected


def test_load_state_dict_loads_the_loss_scalers_then_refuses_unexpected_keys():
    model = torch.nn.Linear(2, 2)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    saved = {"loss_scaler0": {"loss_scale": 512.0, "unskipped": 7}, "optimizer": {}}
    with pytest.raises(RuntimeError, match="Unexpected key\\(s\\) in state_dict: 'optimizer'") as info:
        amp.load_state_dict(saved)
    assert isinstance(info.value, amp_patch.ConfigError)
    assert AMP_STATE.loss_scalers[0].loss_scale() == 512.0 and AMP_STATE.loss_scalers[0]._unskipped == 7
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 64.0, "unskipped": 0}})
    assert AMP_STATE.loss_scalers[0].loss_scale() == 64.0


def test_autocast_utils_follow_the_open_region_as_apex_s_fused_modules_call_them(alias):
    from apex._autocast_utils import _cast_if_autocast_enabled, _get_current_dtype

    x = torch.randn(3)
    assert _cast_if_autocast_enabled(x, (3,), 1e-5)[0] is x and _get_current_dtype() is torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = _cast_if_autocast_enabled(x, (3,), 1e-5)
        assert cast[0].dtype is torch.bfloat16 and cast[1:] == ((3,), 1e-5)
        assert _get_current_dtype() is torch.bfloat16


def test_fused_adam_has_the_kernel_attributes_subclasses_call(alias):
    """fairseq's FusedAdamV2 subclasses apex's FusedAdam and calls ``multi_tensor_applier(self.multi_tensor_adam,
    self._dummy_overflow_buf, [g, p, m, v], ...)`` itself."""
    from apex.multi_tensor_apply import multi_tensor_applier
    from apex.optimizers import FusedAdam

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    reference = FusedAdam([torch.nn.Parameter(p.detach().clone())], lr=0.1)
    reference.param_groups[0]["params"][0].grad = p.grad.clone()
    reference.step()
    opt = FusedAdam([p], lr=0.1)
    m, v = torch.zeros(5), torch.zeros(5)
    multi_tensor_applier(opt.multi_tensor_adam, opt._dummy_overflow_buf, [[p.grad], [p.data], [m], [v]], 0.1, 0.9,
                         0.999, 1e-8, 1, opt.adam_w_mode, 1, 0.0)
    assert torch.equal(p.data, reference.param_groups[0]["params"][0].data)
    assert opt._dummy_overflow_buf.dtype is torch.int32 and opt._dummy_overflow_buf.item() == 0
