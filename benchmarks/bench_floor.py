"""The floor under the small-model step: how far above native autocast the least each recipe can do already is.

Usage: python benchmarks/bench_floor.py [--processes 16] [--blocks 10] [--steps 100] [--dtype bfloat16|float16]
                                        [--bound 1.05]

Each process builds bench_small_step's MLP (3 layers, width 64, batch 32, AdamW, 1 thread) once and runs
``--blocks`` rounds; a round runs every variant (order rotated) for ``--steps`` steps on that one model and
optimizer (``bench_small_step._steps``). A process's figure for a variant is its median block over native's median
block. Where tensors land in memory moves a step of this size by up to 10-40% between processes, so the script
reports each variant's median and quartiles over processes and, against ``--bound``, how many processes read above
it with a two-sided sign test (a variant is "above" or "below" the bound only where p is small).

"native + finite check" is the least any recipe that skips a step on inf/NaN grads does (amp_patch's ``scale_loss``
at every opt level and dtype: Apex's behaviour); it is O1's floor. "hand O1" is the least O1 with amp_patch's
design does, inline (two forward hooks on the model switching native autocast, the loss cast outside the forward,
a class-block scale_loss doing only the check, a one-frame step wrapper). "hand O2" is the least an O2 step does, inline
with no amp_patch (each param cast per step, input half, output fp32, one fused check); it is O2's floor. Nothing
here is asserted in tests.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import _C

VARIANTS = ("native", "native + finite check", "hand O1", "hand O2", "O1", "O2")


class _HandScaleLoss:
    """``scale_loss`` at its least (scale 1.0): the loss as is, then one fused inf/NaN check and its host read."""

    def __init__(self, params, state):
        self.params, self.state = params, state
        self.found, self.inv = torch.zeros(1), torch.ones(1)

    def __call__(self, loss):
        self.loss = loss
        return self

    def __enter__(self):
        return self.loss

    def __exit__(self, *exc):
        self.found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in self.params], self.found, self.inv)
        self.state["skip"] = bool(self.found.item())


def hand_o1_hooks(model, dtype):
    """hand O1's forward hooks on ``model``: native autocast on for its forward with torch's C functions (the root
    takes torch's slow call path, as under amp_patch). Returns the handles."""
    prior = []

    def pre(module, inputs):
        prior.append((_C.is_autocast_enabled("cpu"), _C.get_autocast_dtype("cpu")))
        _C.set_autocast_dtype("cpu", dtype)
        _C.set_autocast_enabled("cpu", True)
        _C.autocast_increment_nesting()

    def post(module, inputs, output):
        if _C.autocast_decrement_nesting() == 0:
            _C.clear_autocast_cache()
        enabled, saved = prior.pop()
        _C.set_autocast_enabled("cpu", enabled)
        _C.set_autocast_dtype("cpu", saved)

    return [model.register_forward_pre_hook(pre), model.register_forward_hook(post, always_call=True)]


def _hand_o1(model, optimizer, x, y, args, clock):
    """The least an O1 step with amp_patch's design does, inline: a forward pre-hook and an always-called hook on the
    model switching native autocast on for its forward (the root takes torch's slow call path, as under amp_patch),
    the loss cast to fp32 outside it, a class-block ``scale_loss`` doing only the check, a one-frame step wrapper
    that pauses casting. Returns the median step, as ``bench_small_step._steps``."""
    paused, state = set(), {"skip": False}

    def step():
        paused.add(0)
        try:
            return optimizer.step()
        finally:
            paused.discard(0)

    handles = hand_o1_hooks(model, args.dtype)
    scale_loss, times = _HandScaleLoss(list(model.parameters()), state), []
    try:
        for i in range(args.steps + 10):
            start = clock()
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x).float(), y)
            with scale_loss(loss) as scaled:
                scaled.backward()
            if not state["skip"]:
                step()
            if i >= 10:
                times.append(clock() - start)
    finally:
        for handle in handles:
            handle.remove()
    return statistics.median(times)


def _child(blocks, steps, dtype_name):
    import torch
    from bench_small_step import _mlp, _steps  # (this script's folder is first on the path)

    torch.set_num_threads(1)
    args = argparse.Namespace(steps=steps, dtype=getattr(torch, dtype_name), op_lists=None)
    model, x, y = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    medians = {v: [] for v in VARIANTS}
    for block in range(blocks):
        k = block % len(VARIANTS)
        for variant in VARIANTS[k:] + VARIANTS[:k]:
            if variant == "hand O1":
                median = _hand_o1(model, optimizer, x, y, args, time.thread_time)
            else:
                median = _steps(variant, model, optimizer, x, y, args, time.thread_time)
            medians[variant].append(median)
    native = statistics.median(medians["native"])
    print(json.dumps({v: statistics.median(m) / native for v, m in medians.items() if v != "native"}))


def _sign_p(above, below):
    """Two-sided sign test: the chance of a split at least this uneven if each process were as likely above as below."""
    n, k = above + below, min(above, below)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return _child(int(argv[1]), int(argv[2]), argv[3])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--bound", type=float, default=1.05)
    args = parser.parse_args(argv)
    from bench_bf16_hw import machine_line

    print(machine_line() + f", {args.processes} processes x {args.blocks} rounds x {args.steps} steps, thread clock")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    ratios = {v: [] for v in VARIANTS[1:]}
    for _ in range(args.processes):
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(args.blocks), str(args.steps),
                               args.dtype], capture_output=True, text=True, env=env, check=False)
        if done.returncode:
            sys.exit(f"a process failed:\n{done.stderr[-3000:]}")
        for v, r in json.loads(done.stdout.splitlines()[-1]).items():
            ratios[v].append(r)
    print(f"\n| step / native ({args.dtype}) | median | quartiles | processes above {args.bound} | sign test p |")
    print("|---|---|---|---|---|")
    for v, rs in ratios.items():
        q = statistics.quantiles(rs, n=4) if len(rs) > 1 else [rs[0]] * 3  # (one process: no spread to show)
        above = sum(r > args.bound for r in rs)
        print(f"| {v} | {statistics.median(rs):.3f} | {q[0]:.3f}-{q[2]:.3f} | {above}/{len(rs)} | "
              f"{_sign_p(above, len(rs) - above):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
