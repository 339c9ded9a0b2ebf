"""``amp-patch trace`` lists the ops casting decided on: not the optimizer's own math inside ``step()``, where
casting is paused; ``--device cuda`` on a machine without CUDA is refused naming the fix."""
import pytest
import torch
from torch import nn

import amp_patch
from amp_patch.tools import cli


def test_the_optimizers_step_ops_are_not_listed():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)  # single-tensor AdamW: Tensor.mul_, addcdiv_
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O1", half_dtype=torch.bfloat16,
                                            verbosity=0)
    try:
        with amp_patch.trace(modules=False) as tracer:
            loss = model(torch.randn(3, 4)).float().sum()
            with amp_patch.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
    finally:
        amp_patch.deinitialize()
    listed = {row["qualname"] for row in tracer.report()}
    assert "torch.nn.functional.linear" in listed
    assert not listed & {"torch.Tensor.addcdiv_", "torch.Tensor.addcmul_", "torch.Tensor.mul_", "torch.Tensor.add_"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_trace_on_cuda_without_cuda_names_the_fix(capsys):
    assert cli.main(["trace", "--model", "mlp", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("amp-patch trace: error: --device cuda, but "
                                               "torch.cuda.is_available() is False"), err
    assert "use --device cpu" in err[0]
