"""Issue 19 item 4: O2 masters agree across DDP ranks built from different seeds (2 gloo ranks, 3 steps)."""
import pytest
import torch

import _dist_worker as w

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def test_o2_ranks_seeded_differently_train_bitwise_identical_weights(tmp_path):
    rank0, rank1 = w.run_ranks("_apex_dist_jobs:per_rank_seeds", tmp_path, timeout=60)
    for wrapper in ("torch", "apex"):
        for key in ("params", "masters", "momentum"):
            a, b = rank0[wrapper][key], rank1[wrapper][key]
            assert len(a) == len(b) == 4
            assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b)), (wrapper, key)
        assert {p.dtype for p in rank0[wrapper]["params"]} == {torch.float16}
