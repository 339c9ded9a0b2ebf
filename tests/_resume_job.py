"""Run by tests/behaviour/test_resume_bitwise.py in fresh processes: train, checkpoint at step k, resume, dump final
state."""
import sys

import torch
import torch.nn.functional as F

import amp_patch


def build(level):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return amp_patch.initialize(model, opt, opt_level=level, growth_interval=2, verbosity=0)


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(6, 4, generator=g)
    return (x * float("inf") if i == 1 else x), torch.randn(6, 2, generator=g)  # step 1 overflows


def train(model, opt, steps):
    for i in steps:
        x, y = batch(i)
        opt.zero_grad()
        with amp_patch.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()


def main(level, mode, path, total=6, k=3):
    model, opt = build(level)
    if mode == "resume":
        ckpt = torch.load(path + ".ckpt")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        amp_patch.load_state_dict(ckpt["amp"])
        train(model, opt, range(k, total))
    else:
        train(model, opt, range(k if mode == "save" else total))
        if mode == "save":
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp_patch.state_dict()},
                       path + ".ckpt")
            amp_patch.deinitialize()
            return
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp_patch.state_dict(),
                "half": [p.detach().clone() for p in model.parameters()]}, path + f".{mode}")
    amp_patch.deinitialize()


if __name__ == "__main__":
    _, stage, prefix, *levels = sys.argv
    for lvl in levels:  # stage "first": uninterrupted run + checkpoint; stage "second": resume (fresh process)
        for step_mode in (("full", "save") if stage == "first" else ("resume",)):
            main(lvl, step_mode, f"{prefix}-{lvl}")
