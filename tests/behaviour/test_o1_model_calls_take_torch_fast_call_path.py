"""An O1 model's calls go through amp_patch's call-through (``model._compiled_call_impl``, which torch's
``Module.__call__`` calls in place of ``_call_impl``): it opens and closes the forward's casting region itself, so
the model's own hook pair reads empty behind it and torch's fast call path runs (``_torch.quiet_hooks``).

What must not change: the forward casts (native inside, as the hooks did), a user's hook on the model runs in
the region whenever it was registered, ``model.compile()`` (which replaces the call-through) turns the hooks back
on, copies and pickles of the model call torch's own path, deinitialize gives the model back as it was.
"""
import copy
import pickle
import sys
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import amp_patch

_native_on = torch._C.is_autocast_enabled


class _Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append(_native_on("cpu"))
        return self.lin(x)


def _slow_calls(fn):
    """Module calls that ran torch's slow path (its nested ``inner``, which runs hooks) during ``fn()``."""
    count = 0
    outer = torch.nn.Module._call_impl.__code__

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_name == "inner" and frame.f_back is not None \
                and frame.f_back.f_code is outer:
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _o1(model):
    return amp_patch.initialize(model, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)


@pytest.fixture
def model():
    model = _o1(_Probe())
    yield model
    amp_patch.deinitialize()


def test_the_call_runs_no_hook_and_casts_natively(model):
    x = torch.randn(2, 4)
    assert _slow_calls(lambda: model(x)) == 0
    assert model(x).dtype is torch.bfloat16
    assert model.seen[-1] is True


def test_a_users_hooks_run_inside_the_region(model):
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(_native_on("cpu")))
    model.register_forward_hook(lambda m, args, out: seen.append(_native_on("cpu")))
    assert model(torch.randn(2, 4)).dtype is torch.bfloat16
    assert seen == [True, True] and model.seen[-1] is True
    assert not _native_on("cpu")


def test_a_hook_registered_before_initialize_keeps_the_hook_path():
    seen = []
    probe = _Probe()
    handle = probe.register_forward_pre_hook(lambda m, args: seen.append(1))
    model = _o1(probe)
    try:
        assert model._compiled_call_impl is None and type(model._forward_pre_hooks) is OrderedDict
        assert model(torch.randn(2, 4)).dtype is torch.bfloat16
        assert model.seen[-1] is True and seen == [1]
    finally:
        amp_patch.deinitialize()
    handle.remove()
    assert not model._forward_pre_hooks


def test_replacing_the_call_through_turns_the_hooks_back_on(model):
    model._compiled_call_impl = model._call_impl  # what model.compile() does, with torch.compile around it
    assert _slow_calls(lambda: model(torch.randn(2, 4))) == 1
    assert model.seen[-1] is True
    assert not _native_on("cpu")


def test_copies_and_pickles_call_torchs_own_path(model):
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert other._compiled_call_impl is None
        assert type(other._forward_pre_hooks) is OrderedDict and type(other._forward_hooks) is OrderedDict
        other.seen.clear()
        other(torch.randn(2, 4))
        assert other.seen == [False]


def test_deinitialize_gives_the_model_back_as_it_was():
    model = _o1(_Probe())
    amp_patch.deinitialize()
    assert model._compiled_call_impl is None
    assert type(model._forward_pre_hooks) is OrderedDict and not model._forward_pre_hooks
    assert type(model._forward_hooks) is OrderedDict and not model._forward_hooks
    assert model(torch.randn(2, 4)).dtype is torch.float32 and model.seen[-1] is False


def test_a_users_hook_outliving_the_session_still_runs_and_its_handle_removes_it():
    model = _o1(_Probe())
    seen = []
    handle = model.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    amp_patch.deinitialize()
    model(torch.randn(2, 4))
    assert seen == [torch.float32]
    handle.remove()
    assert not model._forward_hooks
    assert _slow_calls(lambda: model(torch.randn(2, 4))) == 0
