"""What ``amp-patch speed``'s instrumentation costs: its phase timers (timed steps against plain steps,
neighbouring pairs, as the report measures it) and its probe steps (against plain steps; not used as times),
over several reports of the built-in jobs. Prints ratios; asserts nothing.

    python benchmarks/bench_speed_overhead.py [--reports 5] [--steps 40] [--opt-level O1] [--threads 1]
"""
import argparse
import statistics

import torch

import amp_patch
from amp_patch.tools.experiment.models import BUILTIN, builtin_spec
from amp_patch.tools.machine import describe


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{describe(args.device)}; {args.reports} reports x {args.steps} steps, {args.opt_level}")
    print("| job | step ms (median) | phase timers: timed/plain - 1, median (min..max) | probe steps / plain - 1 |")
    print("|---|---|---|---|")
    for name in BUILTIN:
        reports = [amp_patch.speed_report(builtin_spec(name), opt_level=args.opt_level, steps=args.steps,
                                          device=args.device) for _ in range(args.reports)]
        over = [r.overhead for r in reports]
        probe = statistics.median(r.probe_overhead for r in reports)
        print(f"| {name} | {statistics.median(r.step_ms for r in reports):.2f} | {statistics.median(over):+.1%} "
              f"({min(over):+.1%}..{max(over):+.1%}) | {probe:+.0%} |")


if __name__ == "__main__":
    main()
