"""The fp8 category on a GPU with float8 kernels (CUDA compute capability >= 8.9); skipped elsewhere.

On the CPU, tests/oracle/test_fp8_matches_torchao.py holds the numerics against torchao; here the same wrapper
must run cuBLAS's scaled matmul (whose size rules are the reason for the half fallback), train, and compile."""
import copy

import pytest
import torch
from torch import nn

import amp_patch
from amp_patch.tools.machine import fp8_hardware

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not fp8_hardware("cuda").native,
                                reason="no CUDA device with float8 kernels (compute capability >= 8.9)")


def _mlp(out=16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, out)).cuda()


def _train(model, op_lists, steps=5):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, op_lists=op_lists,
                                      verbosity=0)
    g = torch.Generator(device="cuda").manual_seed(0)
    losses = []
    try:
        for _ in range(steps):
            x = torch.randn(32, 64, device="cuda", generator=g)
            out = model(x)
            loss = out.float().pow(2).mean()
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        amp_patch.deinitialize()
    return out, losses


@pytest.mark.parametrize("op_lists", ["fp8_linear_cuda", "fp8_linear_cuda_rowwise"])
def test_fp8_trains_on_cuda_close_to_bf16(op_lists):
    out, losses = _train(_mlp(), op_lists)
    _, bf16 = _train(_mlp(), "torch_cuda")
    assert out.dtype == torch.bfloat16 and out.is_cuda
    assert all(abs(a - b) <= 0.05 * abs(b) for a, b in zip(losses, bf16)), (losses, bf16)


def test_odd_sizes_fall_back_to_half_on_cuda_and_the_trace_counts_them():
    model = amp_patch.initialize(_mlp(out=10), opt_level="O1", half_dtype=torch.bfloat16,
                                 op_lists="fp8_linear_cuda", verbosity=0)
    try:
        with amp_patch.trace() as tracer:
            out = model(torch.randn(32, 64, device="cuda"))
            out.float().sum().backward()
    finally:
        amp_patch.deinitialize()
    rows = {row["module"]: row["fp8"] for row in tracer.report()}
    assert rows["0"].startswith("fp8 1 (tensorwise)") and rows["2"] == "fp8 0, half fallback 1"


def test_compiled_fp8_on_cuda_runs_without_graph_breaks():
    torch._dynamo.reset()
    model = amp_patch.initialize(copy.deepcopy(_mlp()), opt_level="O1", half_dtype=torch.bfloat16,
                                 op_lists="fp8_linear_cuda", verbosity=0)
    x = torch.randn(32, 64, device="cuda")
    try:
        eager = model(x)
        explanation = torch._dynamo.explain(model)(x)
        compiled = torch.compile(model, backend="aot_eager")(x)  # inductor: minutes of the GPU check
    finally:
        amp_patch.deinitialize()
        torch._dynamo.reset()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert compiled.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager, rtol=0.02, atol=0.02)
