"""User registrations (Apex API): register_*_function before initialize, and their misuse."""
import types

import pytest
import torch
import torch.nn.functional as F

import amp_patch


def test_register_float_function_makes_sigmoid_fp32_and_bce_usable():
    amp_patch.register_float_function(torch, "sigmoid")
    model = amp_patch.initialize(torch.nn.Linear(3, 1), opt_level="O1", verbosity=0)
    logits = model(torch.randn(4, 3))
    assert logits.dtype is torch.float16
    probs = torch.sigmoid(logits)
    assert probs.dtype is torch.float32
    loss = F.binary_cross_entropy(probs, torch.rand(4, 1))  # fp32 input: the banned op is only banned on half
    assert loss.dtype is torch.float32


def test_banned_op_on_half_input_raises_and_allow_banned_runs_it_in_fp32():
    # Apex's list bans binary_cross_entropy on half input (the default torch_cpu list does not ban it)
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", op_lists="apex", verbosity=0)
    half = torch.rand(3).half()
    with pytest.raises(amp_patch.BannedOpError, match="BCEWithLogitsLoss"):
        F.binary_cross_entropy(half, half)
    amp_patch.deinitialize()
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", op_lists="apex", allow_banned=True, verbosity=0)
    assert F.binary_cross_entropy(half, half).dtype is torch.float32


def test_registration_of_a_user_module_function_and_exact_restore():
    user = types.ModuleType("user_ops")
    user.fused = lambda a, b: a @ b
    original = user.fused
    amp_patch.register_half_function(user, "fused")
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", verbosity=0)
    assert user.fused(torch.randn(2, 2), torch.randn(2, 2)).dtype is torch.float16
    amp_patch.deinitialize()
    assert user.fused is original


def test_registration_overrides_the_list_entry_for_the_same_site():
    amp_patch.register_half_function(torch, "exp")  # exp is float in the apex list
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", verbosity=0)
    assert torch.exp(torch.randn(3)).dtype is torch.float16


def test_register_promote_function():
    user = types.ModuleType("user_ops")
    user.combine = lambda a, b: a + b
    amp_patch.register_promote_function(user, "combine")
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", verbosity=0)
    assert user.combine(torch.ones(2).half(), torch.ones(2).bfloat16()).dtype is torch.float32


def test_registration_misuse():
    with pytest.raises(amp_patch.ConfigError, match="has no attribute 'sigmoidd'"):
        amp_patch.register_float_function(torch, "sigmoidd")
    amp_patch.initialize(torch.nn.Linear(1, 1), opt_level="O1", verbosity=0)
    with pytest.raises(amp_patch.UsageError, match="before amp_patch.initialize"):
        amp_patch.register_half_function(torch, "sigmoid")
