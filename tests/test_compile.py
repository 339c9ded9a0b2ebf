"""O1 under torch.compile: same output dtypes as eager and no graph break caused by the wrappers."""
import pytest
import torch

import amp_patch
from tests_support import SmallNet


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_compiled_o1_matches_eager_dtypes_without_graph_breaks(half):
    torch._dynamo.reset()
    model = amp_patch.initialize(SmallNet(), opt_level="O1", half_dtype=half, verbosity=0)
    x = torch.randn(3, 8)
    eager = model(x)
    assert [t.dtype for t in eager] == [half, torch.float32]
    compiled = torch.compile(model, backend="eager")(x)
    assert [t.dtype for t in compiled] == [t.dtype for t in eager]
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    torch._dynamo.reset()
