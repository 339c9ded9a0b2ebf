"""CUDA checks: run where a GPU is present, skipped cleanly elsewhere (CI has none)."""
import pytest
import torch
import torch.nn.functional as F
from tests_support import CountCasts

import amp_patch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
HALVES = [torch.float16, torch.bfloat16]


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 4)).cuda()


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
def test_o1_on_cuda_dtypes_cache_and_grads(half):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=half, verbosity=0)
    x = torch.randn(8, 16, device="cuda")
    with CountCasts() as counter:
        out = model(x)
        model(x)
    assert out.dtype is half and F.softmax(out, -1).dtype is torch.float32
    # first forward: x, weight1, bias1 to half; gelu (float list) input to fp32; linear2 input, weight2, bias2 to
    # half. Second forward: the same (each forward of a session's model starts with an empty cast cache, as a
    # torch.autocast region does: a weight may have changed through .data in between).
    f32 = torch.float32
    assert counter.dtypes == [half, half, half, f32, half, half, half] * 2
    with amp_patch.scale_loss(out.float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(p.grad.dtype is torch.float32 and p.grad.is_cuda for p in model.parameters())
    assert not amp_patch.last_step_skipped(opt)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_training_steps_and_overflow_skip_on_cuda(level):
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")
    for i in range(6):
        opt.zero_grad()
        loss = F.mse_loss(model(x * float("inf") if i == 3 else x).float(), y)
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        assert amp_patch.last_step_skipped(opt) == (i == 3)
    assert all(torch.isfinite(p).all() for p in amp_patch.master_params(opt))


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
def test_torch_cuda_list_matches_native_cuda_autocast(half):
    """Native CUDA autocast is the oracle here: same output dtype for every entry of torch's CUDA table."""
    pytest.importorskip("expecttest")
    from torch.testing._internal.autocast_test_lists import AutocastTestLists

    lists = AutocastTestLists(torch.device("cuda"))
    checked = 0
    for name in ("torch_fp16", "torch_fp32", "nn_fp16", "nn_fp32", "torch_need_autocast_promote"):
        module = torch._C._nn if name.startswith("nn_") else torch
        for entry in getattr(lists, name):
            op, args = entry[0], entry[1]
            if not isinstance(op, str) or not hasattr(module, op) or op.startswith("cudnn"):
                continue
            args = [a.to(half) if isinstance(a, torch.Tensor) and a.dtype is torch.float16 else a for a in args]
            kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
            try:
                with torch.autocast("cuda", dtype=half):
                    native = getattr(module, op)(*args, **kwargs)
            except RuntimeError:
                continue  # e.g. ops without a bf16 CUDA kernel
            with amp_patch.autocast(op_lists="torch_cuda", half_dtype=half):
                ours = getattr(module, op)(*args, **kwargs)
            native = native[0] if isinstance(native, tuple) else native
            ours = ours[0] if isinstance(ours, tuple) else ours
            assert ours.dtype == native.dtype, (name, op)
            checked += 1
    assert checked > 50
