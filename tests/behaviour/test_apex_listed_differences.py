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
