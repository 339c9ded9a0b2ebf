"""Inside a call of an O2 model, its layers take torch's fast call path (no hook runs), as with no amp_patch.

Every module owning cast params carries O2's hook pair for a call it may start itself; inside a call the model
started the pair has nothing to do, so its hook dicts read empty there (``_torch.quiet_hooks``). What must not
change: a layer called on its own (or in another thread, or a copy of it, or a layer given another's hook dicts)
starts and ends its own call, a user's hook on a layer runs inside the model's call whenever it was registered,
handles remove what they registered before and after deinitialize, deinitialize gives plain dicts back and lets
the session go, copies and pickles of the model hold plain dicts, the dicts copy and merge as plain dicts.
"""
import copy
import pickle
import sys
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import amp_patch

HALF = torch.bfloat16


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _o2(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp_patch.initialize(model, opt, opt_level="O2", half_dtype=HALF, verbosity=0)


def _slow_calls(fn):
    """How many module calls ran torch's slow path (its nested ``inner``, which runs hooks) during ``fn()``."""
    count = 0
    inner = torch.nn.Module._call_impl.__code__

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_name == "inner" and frame.f_back is not None \
                and frame.f_back.f_code is inner:
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


@pytest.fixture
def session():
    model, opt = _o2(_model())
    yield model, opt
    amp_patch.deinitialize()


def test_only_the_model_call_runs_hooks_inside_a_forward(session):
    model, _ = session
    x = torch.randn(2, 8)
    assert _slow_calls(lambda: model(x)) == 1  # the model's own pair; its three Linear layers run none


def test_a_layer_called_on_its_own_still_computes_on_half_copies(session):
    model, _ = session
    out = model[0](torch.randn(2, 8, dtype=HALF))
    assert out.dtype == HALF
    assert model[0].weight.dtype == torch.float32  # (after its call: the fp32 param again)


def test_a_users_hook_on_a_layer_runs_inside_the_models_call(session):
    model, _ = session
    seen = []
    handle = model[2].register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    model(torch.randn(2, 8))
    handle.remove()
    model(torch.randn(2, 8))
    assert seen == [HALF]



@pytest.mark.parametrize("dict_name", ["_forward_pre_hooks", "_forward_hooks"])
def test_a_users_hook_in_place_of_amp_patchs_runs_inside_the_models_call(session, dict_name):
    """A library clearing a layer's hooks and adding its own leaves one hook there, not amp_patch's: it runs."""
    model, _ = session
    seen = []
    getattr(model[2], dict_name).clear()
    if dict_name == "_forward_hooks":
        model[2].register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    else:
        model[2].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    model(torch.randn(2, 8))
    assert seen == [HALF]

def test_a_hook_registered_before_initialize_keeps_plain_dicts_and_runs():
    model = _model()
    seen = []
    handle = model[0].register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    model, _ = _o2(model)
    try:
        model(torch.randn(2, 8))
        assert seen == [HALF]
        assert type(model[0]._forward_pre_hooks) is OrderedDict
    finally:
        amp_patch.deinitialize()
    handle.remove()
    assert not model[0]._forward_pre_hooks


def test_deinitialize_gives_plain_empty_dicts_back():
    model, _ = _o2(_model())
    amp_patch.deinitialize()
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            assert type(hooks) is OrderedDict and not hooks
    assert _slow_calls(lambda: model(torch.randn(2, 8))) == 0


def test_a_users_hook_outliving_the_session_still_runs_and_its_handle_removes_it():
    model, _ = _o2(_model())
    seen = []
    handle = model[4].register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    amp_patch.deinitialize()
    model(torch.randn(2, 8))
    assert seen == [torch.float32]
    handle.remove()
    assert not model[4]._forward_hooks
    assert _slow_calls(lambda: model(torch.randn(2, 8))) == 0


def test_copies_and_pickles_of_the_model_hold_plain_dicts(session):
    model, _ = session
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        for module in other.modules():
            assert type(module._forward_pre_hooks) is OrderedDict
            assert type(module._forward_hooks) is OrderedDict
        assert other(torch.randn(2, 8)).dtype == torch.float32


def test_a_layer_called_in_another_thread_during_the_models_call_starts_its_own_call(session):
    import threading

    model, _ = session
    inside, done, seen = threading.Event(), threading.Event(), []

    class Wait(nn.Module):
        def forward(self, x):
            inside.set()
            done.wait(10)
            return x

    model.append(Wait())

    def other():
        inside.wait(10)
        seen.append(model[0](torch.randn(2, 8, dtype=HALF)).dtype)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    model(torch.randn(2, 8))
    thread.join()
    assert seen == [HALF]


def test_a_shallow_copy_of_a_layer_called_on_its_own_ends_its_call(session):
    model, _ = session
    head = copy.copy(model[2])  # (shares the layer's hook dicts)
    x = torch.randn(2, 8, dtype=HALF)
    head(x.float())  # (its slots are the layer's, not its own: it runs on what it holds, as before)
    assert model[2].weight.dtype == torch.float32  # no call left open
    assert model[2](x).dtype == HALF
    assert model(torch.randn(2, 8)).dtype == torch.float32


def test_a_layer_given_another_layers_hook_dicts_ends_its_own_call(session):
    model, _ = session
    for name in ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called"):
        setattr(model[2], name, getattr(model[0], name))  # (transformers does this for tied embeddings)
    with torch.no_grad():
        assert model[2](torch.randn(2, 8, dtype=HALF)).dtype == HALF
    assert model[2].weight.dtype == torch.float32
    assert model(torch.randn(2, 8)).dtype == torch.float32


def test_the_dicts_copy_and_merge_as_plain_dicts(session):
    model, _ = session
    hooks = model[0]._forward_hooks
    assert type(hooks.copy()) is OrderedDict and hooks.copy() == OrderedDict(hooks)
    assert type(hooks | {}) is OrderedDict and dict(hooks | {}) == dict(hooks)
    assert dict({} | hooks) == dict(hooks) and dict(OrderedDict() | hooks) == dict(hooks)


def test_a_users_hook_left_on_a_layer_does_not_keep_the_session_alive():
    import gc
    import weakref

    model, _ = _o2(_model())
    copies = weakref.ref(model[0]._forward_hooks.owner)  # (this session's ComputeCopies)
    model[0].register_forward_hook(lambda m, args, out: None)
    amp_patch.deinitialize()
    gc.collect()
    assert copies() is None
    assert model(torch.randn(2, 8)).dtype == torch.float32
