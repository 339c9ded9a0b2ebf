"""Per-call cost of amp_patch's O1 wrappers vs native torch.autocast, inside and outside a model forward.

Usage: python benchmarks/bench_hot_path.py [--dtype bfloat16|float16] [--rounds 7] [--calls 2000]

"inside a forward": the op runs in the forward of a model passed to ``initialize`` (the training path: the cast
cache is live); "outside": the same op called directly after ``initialize`` (no region amp_patch knows). Native
autocast is entered once around the timed loop in both. Rounds interleave plain / native / amp_patch; medians of
per-round ratios. Prints the machine's CPU flags and load.
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import amp_patch

try:
    from bench_bf16_hw import machine_line
except ImportError:  # run from elsewhere
    from benchmarks.bench_bf16_hw import machine_line


def _cases():
    x = torch.randn(8, 8)
    w = torch.nn.Parameter(torch.randn(8, 8))
    b = torch.nn.Parameter(torch.randn(8))
    a, c = torch.randn(8), torch.randn(8)
    img = torch.randn(1, 3, 8, 8)
    cw = torch.nn.Parameter(torch.randn(4, 3, 3, 3))
    cb = torch.nn.Parameter(torch.randn(4))
    return {
        "F.linear 8x8": lambda: F.linear(x, w, b),
        "torch.add": lambda: torch.add(a, c),
        "F.conv2d (7 args)": lambda: F.conv2d(img, cw, cb, (1, 1), (1, 1), (1, 1), 1),
        "x * 0.5": lambda: a * 0.5,
    }


class _Loop(torch.nn.Module):
    """A model whose forward runs ``fn`` ``calls`` times (the timed region is inside the forward)."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))
        self.fn, self.calls, self.elapsed = None, 0, 0.0

    def forward(self):
        fn = self.fn
        start = time.perf_counter()
        for _ in range(self.calls):
            fn()
        self.elapsed = time.perf_counter() - start
        return self.p


def _time(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _ours(model, fn, calls, inside):
    if not inside:
        return _time(fn, calls)
    model.fn, model.calls = fn, calls
    model()
    return model.elapsed / calls * 1e6


def measure(dtype, rounds, calls, op_lists):
    """Per round: plain and native with no session, then an O1 session (inside and outside its forward)."""
    cases = _cases()
    results = {}
    for _ in range(rounds):
        base = {}
        for name, fn in cases.items():
            plain = _time(fn, calls)
            with torch.autocast("cpu", dtype=dtype):
                base[name] = (plain, _time(fn, calls))
        model = amp_patch.initialize(_Loop(), opt_level="O1", half_dtype=dtype, op_lists=op_lists, verbosity=0)
        try:
            for name, fn in cases.items():
                for inside in (True, False):
                    results.setdefault((name, inside), []).append(base[name] + (_ours(model, fn, calls, inside),))
        finally:
            amp_patch.deinitialize()
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--op-lists", default=None, help="op list of the O1 session (default: initialize's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(machine_line())
    results = measure(getattr(torch, args.dtype), args.rounds, args.calls, args.op_lists)
    print(f"\n| case ({args.dtype}) | where | plain us | native us | amp_patch O1 us | amp_patch / native |")
    print("|---|---|---|---|---|---|")
    for (name, inside), rows in results.items():
        plain, native, ours = (statistics.median(col) for col in zip(*rows))
        ratio = statistics.median(o / n for _, n, o in rows)
        print(f"| {name} | {'inside forward' if inside else 'outside'} | {plain:.2f} | {native:.2f} | "
              f"{ours:.2f} | {ratio:.2f}x |")
    print(f"\nload: {os.getloadavg()}")


if __name__ == "__main__":
    main()
