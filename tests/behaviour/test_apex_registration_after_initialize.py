"""``amp.register_*_function`` after ``amp.initialize`` (Apex's API) is kept for the next ``initialize``, as Apex's
registry was, with one warning that the open session does not cast it; amp_patch's own API refuses it."""
import logging

import pytest
import torch

import amp_patch
from amp_patch.legacy import amp


def _init(api):
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    api.initialize(model, opt, opt_level="O1", verbosity=0, **({"half_dtype": torch.float16}
                                                              if api is amp_patch else {}))


@pytest.mark.parametrize("category,expected", [("float", torch.float32), ("half", torch.float16)])
def test_a_registration_after_initialize_applies_from_the_next_initialize(caplog, category, expected):
    _init(amp)
    x = torch.rand(4).half() if category == "float" else torch.rand(4)
    before = torch.sigmoid(x).dtype
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        getattr(amp, f"register_{category}_function")(torch, "sigmoid")
    (record,) = [r for r in caplog.records if "register_" in r.getMessage()]
    assert record.getMessage().startswith(f"amp.register_{category}_function(torch, 'sigmoid') after "
                                          "amp.initialize(): as in Apex it applies from the next amp.initialize()")
    assert torch.sigmoid(x).dtype is before  # (the open session does not cast it)
    amp_patch.deinitialize()
    _init(amp)
    assert torch.sigmoid(x).dtype is expected


def test_amp_patch_s_own_registration_after_initialize_is_refused():
    _init(amp_patch)
    with pytest.raises(amp_patch.UsageError, match="must be called before amp_patch.initialize"):
        amp_patch.register_float_function(torch, "sigmoid")
