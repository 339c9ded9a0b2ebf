"""Per-call cost of amp_patch's O1 wrappers vs native torch.autocast (entered once), measured interleaved.

Usage: python benchmarks/bench_per_call.py [--dtype bfloat16|float16] [--rounds 7] [--calls 2000]
Prints microseconds per call and the ratio to native autocast for each case.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import amp_patch


def _time(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _cases(dtype):
    x = torch.randn(8, 8)
    w = torch.randn(8, 8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    a, c = torch.randn(8), torch.randn(8)
    return {
        "F.linear 8x8, grad on": lambda: F.linear(x, w, b),
        "torch.add (promote), same dtype": lambda: torch.add(a, c),
        "a + b (Tensor.__add__)": lambda: a + c,
    }


def _ours(fn, calls, dtype, traced_before):
    with amp_patch.autocast(half_dtype=dtype):
        if traced_before:  # tracing off after a trace() region: the plain wrappers are back
            with amp_patch.trace():
                fn()
        return _time(fn, calls)


def measure(dtype, rounds, calls):
    results = {}
    cases = _cases(dtype)
    cases["F.linear, tracing off after a trace() region"] = cases["F.linear 8x8, grad on"]
    for _ in range(rounds):
        for name, fn in cases.items():
            plain = _time(fn, calls)
            with torch.autocast("cpu", dtype=dtype):
                native = _time(fn, calls)
            ours = _ours(fn, calls, dtype, traced_before=name.startswith("F.linear, tracing"))
            results.setdefault(name, []).append((plain, native, ours))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    results = measure(dtype, args.rounds, args.calls)
    print(f"| case ({args.dtype}) | plain us | native autocast us | amp_patch O1 us | amp_patch / native |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        plain, native, ours = (statistics.median(col) for col in zip(*rows))
        ratio = statistics.median(o / n for _, n, o in rows)
        print(f"| {name} | {plain:.2f} | {native:.2f} | {ours:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
