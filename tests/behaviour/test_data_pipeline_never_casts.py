"""The data pipeline never casts: a transform that calls a patched op gives fp32 whatever ``num_workers`` is
(DataLoader workers are other processes, where casting is off; the ``num_workers=0`` fetch runs with casting
paused in the training thread), while the model's forward in the same loop casts."""
import multiprocessing

import pytest
import torch

import amp_patch


class Squares(torch.utils.data.Dataset):
    """Each item goes through torch.mm (a half op under O1's lists), as an augmentation might."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        x = torch.full((2, 2), float(i + 1))
        return torch.mm(x, x)


def _collate(items):
    return torch.stack(items) @ torch.eye(2)  # (torch.matmul: patched too)


def _workers():
    can_fork = "fork" in multiprocessing.get_all_start_methods()
    return [0, pytest.param(1, marks=pytest.mark.skipif(not can_fork, reason="fork start method"))]


@pytest.mark.parametrize("workers", _workers())
@pytest.mark.parametrize("region", [False, True])
def test_a_transform_gives_fp32_with_and_without_workers(workers, region):
    model = torch.nn.Linear(2, 2)
    loader = torch.utils.data.DataLoader(Squares(), batch_size=2, num_workers=workers, collate_fn=_collate,
                                         multiprocessing_context="fork" if workers else None)
    if region:
        context = amp_patch.autocast()
    else:
        amp_patch.initialize(model, opt_level="O1", verbosity=0)
        context = torch.enable_grad()
    with context:
        for batch in loader:
            assert batch.dtype is torch.float32
            assert model(batch).dtype is torch.float16  # the training thread still casts
    assert torch.mm(torch.ones(1, 1), torch.ones(1, 1)).dtype is (torch.float16 if not region else torch.float32)
