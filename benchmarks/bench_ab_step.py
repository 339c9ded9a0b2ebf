"""Whether a change moved the small-model step: two source trees of amp_patch, many processes, a significance test.

Usage: python benchmarks/bench_ab_step.py TREE_A TREE_B [--processes 12] [--variant O1|O2] [--blocks 12]
                                          [--steps 100] [--dtype bfloat16|float16]

TREE_A and TREE_B are checkouts holding an ``amp_patch/`` (``git worktree add /tmp/before <commit>``). Each process
imports amp_patch from one tree (``PYTHONPATH``), builds bench_small_step's MLP (3 layers, width 64, batch 32, AdamW,
1 thread) once and runs ``--blocks`` blocks of ``--steps`` steps alternating native autocast and the variant on that
one model and optimizer (amp_patch initialized for the block and undone after it); its figure is the variant's
median block over native's. Processes alternate between the trees. Where tensors land in memory moves a step of this
size by up to 10-40% between processes on a small VM, so one process proves nothing: the script prints each tree's
median and quartiles over processes and a two-sided permutation test of the difference of the medians (20,000
shuffles). Say "faster" only where p is small. Nothing here is asserted in tests.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def _child(variant, blocks, steps, dtype_name):
    import torch
    import torch.nn.functional as F
    from bench_small_step import _mlp  # (this script's folder is first on the path: the tree gives only amp_patch)

    import amp_patch

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    model, x, y = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    medians = {"native": [], variant: []}
    for block in range(blocks):
        for name in (("native", variant) if block % 2 == 0 else (variant, "native")):
            m, opt = model, optimizer
            if name != "native":
                m, opt = amp_patch.initialize(model, optimizer, opt_level=name, half_dtype=dtype, verbosity=0)
            times = []
            for i in range(steps + 5):
                start = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                if name == "native":
                    with torch.autocast("cpu", dtype=dtype):
                        loss = F.cross_entropy(m(x), y)
                    loss.backward()
                else:
                    loss = F.cross_entropy(m(x), y)
                    with amp_patch.scale_loss(loss, opt) as scaled:
                        scaled.backward()
                opt.step()
                if i >= 5:
                    times.append(time.perf_counter() - start)
            if name != "native":
                amp_patch.deinitialize()
            medians[name].append(statistics.median(times))
    print(json.dumps(statistics.median(medians[variant]) / statistics.median(medians["native"])))


def _ratio(tree, args):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", args.variant, str(args.blocks),
                           str(args.steps), args.dtype], capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        sys.exit(f"the process on {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _permutation_p(a, b, shuffles=20000):
    observed = abs(statistics.median(a) - statistics.median(b))
    pool, rng, hits = a + b, random.Random(0), 0
    for _ in range(shuffles):
        rng.shuffle(pool)
        hits += abs(statistics.median(pool[:len(a)]) - statistics.median(pool[len(a):])) >= observed
    return hits / shuffles


def _summary(values):
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3  # (one process: no spread)
    return f"median {statistics.median(values):.4f} (quartiles {q[0]:.4f}-{q[2]:.4f}, n={len(values)})"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return _child(argv[1], int(argv[2]), int(argv[3]), argv[4])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree_a")
    parser.add_argument("tree_b")
    parser.add_argument("--processes", type=int, default=12, help="per tree")
    parser.add_argument("--variant", default="O1", choices=["O1", "O2", "O3"])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args(argv)
    a, b = [], []  # (by position: the same tree given twice is an A/A run)
    for k in range(args.processes):
        for tree, into in ((args.tree_a, a), (args.tree_b, b))[::1 if k % 2 == 0 else -1]:
            into.append(_ratio(tree, args))
    print(f"{args.variant} step / native step, {args.dtype}, {args.blocks} blocks x {args.steps} steps per process")
    print(f"A {args.tree_a}: {_summary(a)}")
    print(f"B {args.tree_b}: {_summary(b)}")
    diff = statistics.median(b) - statistics.median(a)
    print(f"B - A: {diff:+.4f}, two-sided permutation p = {_permutation_p(a, b):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
