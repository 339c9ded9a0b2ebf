"""amp_patch.autocast takes torch.autocast's call shapes with torch's meaning, or refuses them with a message."""
import inspect

import pytest
import torch
from torch.nn import functional as F

import amp_patch

X, W = torch.randn(4, 8), torch.randn(3, 8)


def _linear_dtype(region):
    with region:
        return F.linear(X, W).dtype


SHAPES = [  # (args, kwargs): each is run under torch.autocast and amp_patch.autocast alike
    (("cpu",), {}),
    (("cpu", torch.float16), {}),
    (("cpu", torch.bfloat16, True, True), {}),
    (("cpu",), {"enabled": False}),
    ((), {"device_type": "cpu", "dtype": torch.float16, "enabled": True, "cache_enabled": None}),
    ((), {"device_type": "cpu", "dtype": torch.bfloat16, "enabled": False}),
]


def test_signature_starts_like_torch_autocast():
    ours = list(inspect.signature(amp_patch.autocast).parameters)[:4]
    theirs = [p for p in inspect.signature(torch.autocast.__init__).parameters if p != "self"][:4]
    assert ours == theirs == ["device_type", "dtype", "enabled", "cache_enabled"]


@pytest.mark.parametrize("args, kwargs", SHAPES)
def test_same_dtype_as_torch_autocast(args, kwargs):
    expected = _linear_dtype(torch.autocast(*args, **kwargs))
    assert _linear_dtype(amp_patch.autocast(*args, **kwargs)) == expected


@pytest.mark.parametrize("args, kwargs, match", [
    ((False,), {}, "first argument is device_type"),
    (("O1",), {}, "device type"),
    (("cpu:0",), {}, "no index"),
    (("cpu",), {"cache_enabled": "no"}, "True, False or None"),
    (("cpu",), {"enabled": "yes"}, "True or False"),
    (("cpu", torch.float32), {}, "allowed: torch.float16, torch.bfloat16"),
    (("cpu", torch.float16), {"half_dtype": torch.bfloat16}, "disagree"),
])
def test_refused_with_a_message(args, kwargs, match):
    with pytest.raises(amp_patch.ConfigError, match=match):
        amp_patch.autocast(*args, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_type_without_cuda_is_refused():
    with pytest.raises(amp_patch.ConfigError, match="is_available"):
        amp_patch.autocast("cuda")


def test_a_region_cannot_switch_the_session_dtype():
    model = torch.nn.Linear(8, 3)
    amp_patch.initialize(model, opt_level="O1", half_dtype=torch.float16, verbosity=0)
    try:
        with pytest.raises(amp_patch.UsageError, match="cannot switch the half dtype"):
            with amp_patch.autocast("cpu", dtype=torch.bfloat16):
                pass
        with amp_patch.autocast("cpu", dtype=torch.float16):  # the session's own dtype: fine (a no-op)
            assert model(X).dtype == torch.float16
    finally:
        amp_patch.deinitialize()
