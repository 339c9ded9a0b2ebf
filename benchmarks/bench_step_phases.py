"""Where a small model's step spends amp_patch's time: each phase of the step, against hand O1, in microseconds.

Usage: python benchmarks/bench_step_phases.py [--processes 4] [--rounds 6] [--steps 300] [--dtype bfloat16|float16]

bench_small_step's MLP (3 layers, width 64, batch 32, AdamW, 1 thread). Each process runs every variant in turn
for ``--rounds`` rounds on one model and optimizer, timing the phases of each step with ``time.perf_counter``:
zero_grad, forward, loss, scale_loss's entry (hand O1: its class block's), backward, the exit (the fused
inf/NaN check and its host read; native: the same check inline), step. A process's figure for a phase is the median
over its rounds of each round's median; the table gives the median over processes (placement in memory moves a step
of this size by 10-40% between processes: differences are taken within a process
first). "hand O1" is bench_floor's least O1 of amp_patch's design (its hooks and class block; its step is called
directly). After backward a device object read or a tensor method call costs more than in a hot loop (an empty
Python frame does not: ~0.03 us, 1000 of them after backward +26-33 us a step): this is where a step's bookkeeping
shows, which counting frames or bytecodes alone does not tell. Nothing here is asserted in tests.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

PHASES = ("zero_grad", "forward", "loss", "enter", "backward", "exit", "step")
VARIANTS = ("native", "hand O1", "O1", "O2")


def _phases(variant, model, opt, x, y, steps, dtype):
    from bench_floor import _HandScaleLoss, hand_o1_hooks

    import amp_patch

    clock, skip = time.perf_counter, {"skip": False}
    found, inv, params = torch.zeros(1), torch.ones(1), list(model.parameters())
    handles = hand_o1_hooks(model, dtype) if variant == "hand O1" else []
    hand = _HandScaleLoss(params, skip)
    if variant in ("O1", "O2"):
        model, opt = amp_patch.initialize(model, opt, opt_level=variant, half_dtype=dtype, verbosity=0)
    times = {p: [] for p in PHASES}
    try:
        for i in range(steps + 20):
            t0 = clock()
            opt.zero_grad(set_to_none=True)
            t1 = clock()
            if variant == "native":
                with torch.autocast("cpu", dtype=dtype):
                    out = model(x)
            else:
                out = model(x)
            t2 = clock()
            loss = F.cross_entropy(out if variant in ("O1", "O2") else out.float(), y)
            t3 = clock()
            if variant == "native":
                block, scaled = None, loss
            else:
                block = amp_patch.scale_loss(loss, opt) if variant in ("O1", "O2") else hand(loss)
                scaled = block.__enter__()
            t4 = clock()
            scaled.backward()
            t5 = clock()
            if block is None:
                found.zero_()
                torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in params], found, inv)
                skip["skip"] = bool(found.item())
            else:
                block.__exit__(None, None, None)
            del block
            t6 = clock()
            if variant in ("O1", "O2") or not skip["skip"]:
                opt.step()
            t7 = clock()
            if i >= 20:
                for phase, a, b in zip(PHASES, (t0, t1, t2, t3, t4, t5, t6), (t1, t2, t3, t4, t5, t6, t7)):
                    times[phase].append(b - a)
    finally:
        for handle in handles:
            handle.remove()
        if variant in ("O1", "O2"):
            amp_patch.deinitialize()
    return {p: statistics.median(t) * 1e6 for p, t in times.items()}


def _child(rounds, steps, dtype_name):
    from bench_small_step import _mlp

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    model, x, y = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    found = {v: {p: [] for p in PHASES} for v in VARIANTS}
    for r in range(rounds):
        k = r % len(VARIANTS)
        for variant in VARIANTS[k:] + VARIANTS[:k]:
            for phase, value in _phases(variant, model, opt, x, y, steps, dtype).items():
                found[variant][phase].append(value)
    print(json.dumps({v: {p: statistics.median(t) for p, t in ph.items()} for v, ph in found.items()}))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return _child(int(argv[1]), int(argv[2]), argv[3])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args(argv)
    from bench_bf16_hw import machine_line

    print(machine_line() + f", {args.processes} processes x {args.rounds} rounds x {args.steps} steps, wall clock")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    runs = []
    for _ in range(args.processes):
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(args.rounds),
                               str(args.steps), args.dtype], capture_output=True, text=True, env=env, check=False)
        if done.returncode:
            sys.exit(f"a process failed:\n{done.stderr[-3000:]}")
        runs.append(json.loads(done.stdout.splitlines()[-1]))
    print(f"\n| phase (us, {args.dtype}) | " + " | ".join(VARIANTS) + " | O1 - hand O1 | O2 - hand O1 |")
    print("|---|" + "---|" * (len(VARIANTS) + 2))
    for phase in PHASES + ("total",):
        def value(run, v, phase=phase):
            return sum(run[v].values()) if phase == "total" else run[v][phase]
        cells = [statistics.median(value(run, v) for run in runs) for v in VARIANTS]
        deltas = [statistics.median(value(run, v) - value(run, "hand O1") for run in runs) for v in ("O1", "O2")]
        print(f"| {phase} | " + " | ".join(f"{c:.1f}" for c in cells) + " | "
              + " | ".join(f"{d:+.1f}" for d in deltas) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
