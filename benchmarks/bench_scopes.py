"""Cost of module-scoped op lists on calls outside every scope: O1 step time of the tiny transformer with no
scopes vs with an unrelated scope (naming the model's hot ops, but for modules that never run), rounds
interleaved in one process. A related scope (float linear inside the first self-attention) is shown for
scale. Target (not asserted): unrelated/none <= 1.02. Because whole-step medians on a busy machine drift by
several percent, it also measures the per-call cost directly (F.linear 8x8 and Tensor.__add__ with / without the
unrelated scope, interleaved) and the implied step overhead: calls per step of the scoped ops x extra us / step.

Usage: PYTHONPATH=. python benchmarks/bench_scopes.py [--rounds 7] [--steps 10] [--dtype bfloat16|float16]
"""
import argparse
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step_time import _tiny_transformer_case  # noqa: E402

import amp_patch  # noqa: E402

_HOT = {"torch.nn.functional": ["linear", "scaled_dot_product_attention", "layer_norm"],
        "torch.Tensor": ["__add__"]}
VARIANTS = {
    "none": "apex",
    "unrelated": {"extends": "apex", "scopes": {"no_such_module.**": {"float": _HOT}}},
    "related": {"extends": "apex", "scopes": {"encoder.layers.0.self_attn": {"float": {"torch.nn.functional":
                                                                                        ["linear"]}}}},
}


def _time(variant, dtype, steps):
    torch.manual_seed(0)
    model, x, loss_fn = _tiny_transformer_case()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=dtype, verbosity=0,
                                      op_lists=VARIANTS[variant])
    times = []
    try:
        for step in range(steps + 1):
            start = time.perf_counter()
            opt.zero_grad()
            with amp_patch.scale_loss(loss_fn(model(x)), opt) as scaled:
                scaled.backward()
            opt.step()
            if step:
                times.append((time.perf_counter() - start) * 1e3)
    finally:
        amp_patch.deinitialize()
    return times


def _per_call_us(variant, dtype, rounds=15, n=2000):
    import timeit

    from torch.nn import functional as F
    model = torch.nn.Linear(8, 8)
    amp_patch.initialize(model, opt_level="O1", half_dtype=dtype, verbosity=0, op_lists=VARIANTS[variant])
    try:
        x, w = torch.randn(8, 8), model.weight
        linear = min(timeit.repeat(lambda: F.linear(x, w), number=n, repeat=rounds)) / n * 1e6
        add = min(timeit.repeat(lambda: x + x, number=n, repeat=rounds)) / n * 1e6
    finally:
        amp_patch.deinitialize()
    return linear, add


def _scoped_calls_per_step(dtype):
    model, x, loss_fn = _tiny_transformer_case()
    amp_patch.initialize(model, opt_level="O1", half_dtype=dtype, verbosity=0)
    try:
        with amp_patch.trace(unpatched=False) as t:
            loss_fn(model(x)).float().backward()
    finally:
        amp_patch.deinitialize()
    hot = {f"{target}.{name}" for target, names in _HOT.items() for name in names}
    return sum(r["calls"] for r in t.report() if r["qualname"] in hot)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = parser.parse_args()
    logging.getLogger("amp_patch").setLevel(logging.ERROR)  # the unrelated glob's warning, on purpose
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    samples = {v: [] for v in VARIANTS}
    names = list(VARIANTS)
    for r in range(args.rounds):
        for v in names[r % len(names):] + names[:r % len(names)]:
            samples[v] += _time(v, dtype, args.steps)
    med = {v: statistics.median(s) for v, s in samples.items()}
    print(f"tiny transformer O1 ({args.dtype}), {args.rounds} rounds x {args.steps} steps, median ms per step")
    print("| no scopes ms | unrelated scope ms | related scope ms | unrelated/none | related/none |")
    print("|---|---|---|---|---|")
    print(f"| {med['none']:.2f} | {med['unrelated']:.2f} | {med['related']:.2f} | "
          f"{med['unrelated'] / med['none']:.3f} | {med['related'] / med['none']:.3f} |")
    base = [_per_call_us("none", dtype) for _ in range(3)]
    scoped = [_per_call_us("unrelated", dtype) for _ in range(3)]
    lin0, add0 = min(b[0] for b in base), min(b[1] for b in base)
    lin1, add1 = min(s[0] for s in scoped), min(s[1] for s in scoped)
    calls = _scoped_calls_per_step(dtype)
    extra_ms = calls * max(lin1 - lin0, add1 - add0, 0.0) / 1e3
    print(f"per call, outside every scope: F.linear {lin0:.2f} -> {lin1:.2f} us, Tensor.__add__ {add0:.2f} -> "
          f"{add1:.2f} us; {calls} calls of the scoped ops per step -> implied overhead {extra_ms:.3f} ms per "
          f"step = {1 + extra_ms / med['none']:.4f}x")


if __name__ == "__main__":
    main()
