"""amp_C / apex_C stand-ins and multi_tensor_applier against plain torch computations."""
import subprocess
import sys

import pytest
import torch

from amp_patch.legacy import amp_C, apex_C
from amp_patch.legacy.apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier


def _tensors(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype) for s in [(3, 4), (7,), (2, 2, 2)]]


def _flag():
    return torch.zeros(1, dtype=torch.int)


def test_applier_calls_the_op_with_its_chunk_size():
    calls = []
    result = multi_tensor_applier(lambda *a: calls.append(a) or "out", "flag", [["x"]], 1, 2)
    assert result == "out" and calls == [(2048 * 32, "flag", [["x"]], 1, 2)]
    assert multi_tensor_applier.available is True and multi_tensor_applier.warned is False
    assert MultiTensorApply(64).chunk_size == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_writes_scaled_copies_and_flags_non_finite_inputs(dtype):
    src = _tensors(torch.float32)
    dst = [torch.empty_like(t, dtype=dtype) for t in src]
    flag = _flag()
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [src, dst], 0.25)
    assert all(torch.equal(d, (s * 0.25).to(dtype)) for s, d in zip(src, dst))
    assert flag.item() == 0
    src[1][3] = float("nan")
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [src, dst], 0.25)
    assert flag.item() == 1


@pytest.mark.parametrize("arg_to_check,flagged", [(-1, True), (0, False), (1, True)])
def test_axpby_and_which_argument_it_checks(arg_to_check, flagged):
    xs, ys = _tensors(seed=1), _tensors(seed=2)
    outs = [torch.empty_like(t) for t in xs]
    flag = _flag()
    multi_tensor_applier(amp_C.multi_tensor_axpby, flag, [xs, ys, outs], 2.0, -0.5, arg_to_check)
    assert all(torch.allclose(o, 2.0 * x - 0.5 * y) for x, y, o in zip(xs, ys, outs)) and flag.item() == 0
    ys[0][0, 0] = float("inf")
    multi_tensor_applier(amp_C.multi_tensor_axpby, flag, [xs, ys, outs], 2.0, -0.5, arg_to_check)
    assert bool(flag.item()) is flagged


def test_l2norm_total_and_per_tensor():
    ts = _tensors(torch.bfloat16)
    flag = _flag()
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [ts], True)
    expect = [t.float().norm() for t in ts]
    torch.testing.assert_close(per, torch.stack(expect))
    torch.testing.assert_close(total, torch.stack(expect).norm().reshape(1))
    assert total.dtype == torch.float32 and total.shape == (1,)
    _, none = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [ts], False)
    assert none.numel() == 0 and flag.item() == 0
    ts[2][0, 0, 0] = float("inf")
    multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [ts], False)
    assert flag.item() == 1


def test_l2norm_scale_returns_the_inputs_norm_and_writes_the_scaled_copy():
    src = _tensors(seed=5)
    dst = [torch.empty_like(t) for t in src]
    total, per = amp_C.multi_tensor_l2norm_scale(0, _flag(), [src, dst], 0.5, True)
    torch.testing.assert_close(per, torch.stack([t.norm() for t in src]))
    assert all(torch.equal(d, s * 0.5) for s, d in zip(src, dst)) and total.shape == (1,)


def test_sgd_kernel_skips_while_the_flag_is_set():
    grads, params = _tensors(seed=3), _tensors(seed=4)
    before = [p.clone() for p in params]
    flag = torch.ones(1, dtype=torch.int)
    amp_C.multi_tensor_sgd(0, flag, [grads, params, []], 0.0, 0.0, 0.0, 0.1, False, True, False, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    amp_C.multi_tensor_sgd(0, _flag(), [grads, params, []], 0.0, 0.0, 0.0, 0.1, False, True, False, 0.5)
    assert all(torch.allclose(p, b - 0.1 * 0.5 * g) for p, b, g in zip(params, before, grads))


def test_apex_c_flatten_round_trip():
    ts = _tensors()
    flat = apex_C.flatten(ts)
    assert flat.shape == (sum(t.numel() for t in ts),) and flat.is_contiguous()
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in ts]))
    back = apex_C.unflatten(flat, ts)
    assert all(torch.equal(a, b) for a, b in zip(back, ts))


def test_importing_amp_patch_or_the_apex_package_loads_none_of_the_modules():
    """``import amp_patch`` and ``import amp_patch.legacy.apex`` stay cheap; each module imports on its own."""
    code = ("import sys, amp_patch, amp_patch.legacy.apex\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('amp_patch.legacy.apex.') or m.endswith('amp_C'))\n"
            "assert not loaded, loaded\n"
            "import amp_patch.legacy.apex.optimizers, amp_patch.legacy.apex.parallel.distributed\n"
            "import amp_patch.legacy.apex.normalization, amp_patch.legacy.apex.fp16_utils\n"
            "import amp_patch.legacy.apex.multi_tensor_apply, amp_patch.legacy.amp_C, amp_patch.legacy.apex_C\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
