"""A 2-rank gloo script in the shape of real DDP training scripts: initialize (O2) -> torch DDP -> 3 steps ->
destroy_process_group() -> return, with nothing freed by hand. Run as ``python _ddp_exit_script.py MODE RANK DIR``
with MODE "amp_patch" or "plain" (the same script with torch alone); exit code 0 is a clean exit."""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main(mode, rank, store_dir):
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "amp_patch":
        import amp_patch
        model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2", verbosity=0)
    model = DDP(model)
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank * 10 + step))
        loss = model(x).float().pow(2).mean()
        optimizer.zero_grad()
        if mode == "amp_patch":
            with amp_patch.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        else:
            loss.backward()
        optimizer.step()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
