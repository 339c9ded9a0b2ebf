"""O2 step time against native ``torch.autocast`` where the per-call work of O2's compute copies dominates: 24 x
(Linear(32) + Tanh), batch 8, SGD, bfloat16, 1 thread. Each round times 20 native steps, then 20 O2 steps on a
fresh model (after 3 warm-up steps each); prints the median ratio over the rounds. Compare two checkouts by
running it with each on PYTHONPATH, alternately (this machine's speed drifts: only ratios mean anything).

Usage: python benchmarks/bench_o2_calls.py [rounds]
"""
import statistics
import sys
import time

import torch
import torch.nn as nn

import amp_patch

torch.set_num_threads(1)
X = torch.randn(8, 32)


def build():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(24)])


def steps(model, opt, n, native):
    start = time.perf_counter()
    for _ in range(n):
        if native:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(X).float().sum()
            loss.backward()
        else:
            loss = model(X).float().sum()
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - start) / n


def main(rounds):
    ratios = []
    for _ in range(rounds):
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        steps(model, opt, 3, True)
        native = steps(model, opt, 20, True)
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
        steps(model, opt, 3, False)
        o2 = steps(model, opt, 20, False)
        amp_patch.deinitialize()
        ratios.append(o2 / native)
    print(f"O2/native step time, 24x(Linear(32)+Tanh), batch 8, 1 thread: median {statistics.median(ratios):.3f} "
          f"(rounds {len(ratios)}: min {min(ratios):.3f} max {max(ratios):.3f})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)
