"""What ``amp-patch speed``'s instrumentation costs: its phase timers (timed steps against plain steps, unit by
unit, as the report measures it), its probe steps (against plain steps; not used as times), and its step time
against the experiment's for the same job and opt level (an independent harness, in this process, reports and
experiment runs alternating), over several reports of the built-in jobs. Prints ratios; asserts nothing.

    python benchmarks/bench_speed_overhead.py [--reports 5] [--steps 40] [--opt-level O1] [--threads 1]
"""
import argparse
import statistics

import torch

import amp_patch
from amp_patch.tools.experiment import run_experiment
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
    print("| job | step ms (median) | phase timers: timed/plain - 1, median (min..max) | probe steps / plain - 1 "
          "| speed step less its data wait / experiment step, median (min..max) | data share |")
    print("|---|---|---|---|---|---|")
    for name in BUILTIN:
        reports, ratios = [], []
        for _ in range(args.reports):
            reports.append(amp_patch.speed_report(builtin_spec(name), opt_level=args.opt_level, steps=args.steps,
                                                  device=args.device))
            # the experiment times a step from its batch on; the speed report's step includes the wait for it
            compute = reports[-1].step_ms * (1.0 - reports[-1].phases["data"])
            ratios.append(compute / _experiment_step_ms(name, args))
        over = [r.overhead for r in reports]
        probe = statistics.median(r.probe_overhead for r in reports)
        print(f"| {name} | {statistics.median(r.step_ms for r in reports):.2f} | {statistics.median(over):+.1%} "
              f"({min(over):+.1%}..{max(over):+.1%}) | {probe:+.0%} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}..{max(ratios):.3f}) | {statistics.median(r.phases['data'] for r in reports):.0%} |")


def _experiment_step_ms(name, args):
    variant = "fp32" if args.opt_level == "O0" else args.opt_level
    report = run_experiment([builtin_spec(name)], variants=variant, steps=args.steps, half_dtype=torch.bfloat16,
                            device=args.device, isolate=False, progress=False, threads=args.threads, rounds=1)[0]
    return report["variants"][variant]["median_step_ms"]


if __name__ == "__main__":
    main()
