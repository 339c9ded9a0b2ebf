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
at every opt level and dtype: Apex's behaviour); it is O1's floor. "hand O2" is the least an O2 step does, inline
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

VARIANTS = ("native", "native + finite check", "hand O2", "O1", "O2")


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
            medians[variant].append(_steps(variant, model, optimizer, x, y, args, time.thread_time))
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
        q = statistics.quantiles(rs, n=4)
        above = sum(r > args.bound for r in rs)
        print(f"| {v} | {statistics.median(rs):.3f} | {q[0]:.3f}-{q[2]:.3f} | {above}/{len(rs)} | "
              f"{_sign_p(above, len(rs) - above):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
