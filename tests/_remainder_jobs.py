"""The training loop tests/behaviour/test_remainder_masters.py runs under each O2 master storage (also on 2 gloo ranks).

Every initial weight, and every master after each completed step, has half of its elements planted on an exact
bf16 tie (low 16 bits 0x8000), where the split rule and torch's round-to-nearest-even disagree: a wrong tie rule
or a wrong join shows at once.
A step holds two losses (loss ids 0 and 1, two scale_loss blocks accumulating into the same grads, the first
sometimes with delay_unscale), clips through ``amp_patch.master_params`` and, at step 2, overflows (skipped).
"""
import torch

import amp_patch
from amp_patch.legacy.apex.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

MODES = {
    "remainder": dict(master_weights="remainder"),
    "split": dict(master_weights=True, master_rounding="split"),
    "nearest": dict(master_weights=True),
}

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
    "fused_adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "fused_sgd": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9),
    "fused_lamb": lambda ps: FusedLAMB(ps, lr=1e-2),
    "fused_adagrad": lambda ps: FusedAdagrad(ps, lr=0.05),
    "fused_novograd": lambda ps: FusedNovoGrad(ps, lr=1e-2),
}


def plant_ties(tensor):
    """Every other element of fp32 ``tensor`` becomes an exact bf16 tie (in place)."""
    bits = tensor.detach().view(torch.int32).view(-1)
    bits[::2] = (bits[::2] & ~0xFFFF) | 0x8000


def make_model(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for p in model.parameters():
        plant_ties(p)
    return model


def batch(step, micro, rank=0):
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)


def _plant_ties_after_update(opt, args, kwargs):
    """A step post-hook registered before initialize, so it runs before amp_patch's: every completed step leaves
    ties in the (fp32) masters, which amp_patch's own post-hook then rounds to the model (and splits)."""
    if not amp_patch.last_step_skipped(opt):
        with torch.no_grad():
            for group in opt.param_groups:
                for p in group["params"]:
                    plant_ties(p)


def setup(mode, opt_name, seed=0):
    model = make_model(seed)
    opt = OPTIMIZERS[opt_name](model.parameters())
    opt.register_step_post_hook(_plant_ties_after_update)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, num_losses=2,
                                      loss_scale="dynamic", verbosity=0, **MODES[mode])
    return model, opt


def train_steps(model, opt, steps, start=0, rank=0, forward=None, inf_at=2):
    """``steps`` steps from step ``start``; returns the losses (fp32 tensors) and which steps were skipped."""
    forward = forward or model
    losses, skipped = [], []
    for step in range(start, start + steps):
        for micro in (0, 1):
            x, y = batch(step, micro, rank)
            out = forward(x.to(torch.bfloat16)).float()
            loss = torch.nn.functional.mse_loss(out, y) * (float("inf") if step == inf_at and micro else 1.0)
            with amp_patch.scale_loss(loss, opt, loss_id=micro, delay_unscale=micro == 0 and step % 3 == 1) as s:
                s.backward()
            losses.append(loss.detach().clone())
        torch.nn.utils.clip_grad_norm_(amp_patch.master_params(opt), 0.5)
        opt.step()
        skipped.append(amp_patch.last_step_skipped(opt))
        opt.zero_grad()
    return losses, skipped


def snapshot(model, opt):
    """Everything the equivalence compares, as plain tensors (bits of the model's bf16 params included)."""
    state = opt.state_dict()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "model_state": {k: v.clone() for k, v in model.state_dict().items()},
            "opt_state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                          for i, s in state["state"].items()},
            "amp_state": amp_patch.state_dict()}


def run(mode, opt_name, steps=4):
    model, opt = setup(mode, opt_name)
    try:
        losses, skipped = train_steps(model, opt, steps)
        return {"losses": losses, "skipped": skipped, **snapshot(model, opt)}
    finally:
        amp_patch.deinitialize()


def ddp_modes(rank, world, modes=("remainder", "split"), opt_name="adamw", steps=4):
    """The same loop under DDP (after initialize, broadcast_master_params), once per mode."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for mode in modes:
        model, opt = setup(mode, opt_name, seed=rank)  # different weights per rank: the broadcast must fix them
        try:
            ddp = DDP(model)
            stale = amp_patch.distributed.masters_out_of_sync()  # DDP's broadcast reached the masters too
            amp_patch.distributed.broadcast_master_params()
            synced = amp_patch.distributed.masters_out_of_sync()
            losses, skipped = train_steps(model, opt, steps, rank=rank, forward=ddp)
            results[mode] = {"losses": losses, "skipped": skipped, "stale": stale, "synced": synced,
                             **snapshot(model, opt)}
        finally:
            del ddp
            amp_patch.deinitialize()
    return results
