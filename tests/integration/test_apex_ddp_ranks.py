"""O2 masters agree across DDP ranks built from different seeds (2 gloo ranks, 3 steps), and
Apex's SyncBatchNorm under plain torch DDP on CPU."""
import _dist_worker as w
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return w.run_ranks("_apex_dist_jobs:masters_and_syncbn", tmp_path_factory.mktemp("masters_and_syncbn"), timeout=90)


def test_o2_ranks_seeded_differently_train_bitwise_identical_weights(ranks):
    rank0, rank1 = (r["seeds"] for r in ranks)
    for wrapper in ("torch", "apex"):
        for key in ("params", "masters", "momentum"):
            a, b = rank0[wrapper][key], rank1[wrapper][key]
            assert len(a) == len(b) == 4
            assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b)), (wrapper, key)
        assert {p.dtype for p in rank0[wrapper]["params"]} == {torch.float16}


def test_apex_syncbn_is_accepted_by_plain_torch_ddp_on_cpu_and_syncs(ranks):
    rank0, rank1 = (r["syncbn"] for r in ranks)
    assert torch.equal(rank0["running_mean"], rank1["running_mean"])  # statistics all-reduced over both ranks
    assert torch.equal(rank0["grad"], rank1["grad"])  # DDP averaged the grads
