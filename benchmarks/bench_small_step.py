"""Small-model step time and per-call cost: amp_patch O1 (hybrid and Python engines) and O2 vs native autocast.

Usage: python benchmarks/bench_small_step.py [--rounds 7] [--steps 200] [--calls 2000] [--clock thread|wall]
                                             [--dtype bfloat16|float16] [--op-lists apex] [--width 64] [--batch 32]

Step: a 3-layer MLP (width 64, batch 32), AdamW, 1 thread; every round runs each variant (order rotated) for
``--steps`` steps after 10 warm-up steps, all on the one model and optimizer (amp_patch initialized on them and
undone per variant): where tensors land in memory moves a small step by up to 10-40% between copies of one model,
which per-variant copies turned into ratio noise. The figure is the median over rounds of each round's median
step, and the ratios are taken in this run only. Per call: ``F.linear`` 8x8 (Parameter weight) inside a
forward of the session's model and outside one, vs native ``torch.autocast`` entered once. "native + finite
check" adds what skipping a step on inf/NaN grads costs at the least (one fused check and its host read, as
``GradScaler`` does), which amp_patch's ``scale_loss`` does at every opt level and dtype; "native + GradScaler" is
native's whole fp16 recipe (``scaler.scale(loss).backward()``, ``scaler.step``, ``scaler.update``), the step an fp16
user of native AMP runs (a bf16 user runs plain "native"). "hand O2" is the least an O2 step does, written inline
with no amp_patch (each param cast per step, input half, output fp32, one fused check): O2 / hand O2 is amp_patch's
own O2 cost. ``--clock thread``
(the default) times by the stepping thread's CPU time, which leaves out waits for a core on a shared machine.
Prints the machine line (CPU flags: without bf16/fp16 instructions the kernels are slow, so read the ratios as
overhead ratios). Nothing here is asserted in tests.
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import amp_patch

try:
    from bench_bf16_hw import machine_line
except ImportError:  # run from elsewhere
    from benchmarks.bench_bf16_hw import machine_line

VARIANTS = {"native": None, "native + finite check": None, "native + GradScaler": None, "O1": dict(opt_level="O1"),
            "O1 python engine": dict(opt_level="O1", cast_engine="python"), "O2": dict(opt_level="O2"),
            "hand O2": None}
NATIVE = ("native", "native + finite check", "native + GradScaler", "hand O2")
STEP_ONLY = ("O2", "native + finite check", "native + GradScaler", "hand O2")  # (no per-call figures)


def _mlp(width=64, batch=32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10))
    return model, torch.randn(batch, width), torch.randint(0, 10, (batch,))


def _options(variant, args):
    kwargs = dict(VARIANTS[variant])
    if args.op_lists and kwargs.get("opt_level") == "O1":
        kwargs["op_lists"] = args.op_lists
    return kwargs


def _hand_o2_forward(model, x, y, dtype):
    """The least an O2 forward does, with no amp_patch: each param cast (``p.to(half)``) into its module for the
    forward and the backward, the input cast to half, the output to fp32."""
    swapped = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            module._parameters[name] = p.to(dtype)
            swapped.append((module, name, p))
    try:
        return F.cross_entropy(model(x.to(dtype)).float(), y)
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p


def _native_backward(variant, model, opt, x, y, dtype, scaler, found, inv):
    """A native variant's forward and backward (GradScaler's also steps); whether to skip the step."""
    if variant == "hand O2":
        _hand_o2_forward(model, x, y, dtype).backward()
    else:
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        if scaler is not None:  # native's fp16 recipe: scale, unscale and check in step, update
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return True  # (the scaler stepped)
        loss.backward()
    if found is None:
        return False
    found.zero_()
    torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in model.parameters()], found, inv)
    return bool(found.item())


def _steps(variant, model, opt, x, y, args, clock):
    native = variant in NATIVE
    check = variant in ("native + finite check", "hand O2")  # what skipping on inf/NaN costs at least
    found, inv = (torch.zeros(1), torch.ones(1)) if check else (None, None)
    scaler = torch.amp.GradScaler("cpu") if variant == "native + GradScaler" else None
    if not native:
        model, opt = amp_patch.initialize(model, opt, half_dtype=args.dtype, verbosity=0, **_options(variant, args))
    times = []
    try:
        for i in range(args.steps + 10):
            start, skip = clock(), False
            opt.zero_grad(set_to_none=True)
            if not native:
                loss = F.cross_entropy(model(x), y)
                with amp_patch.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            else:
                skip = _native_backward(variant, model, opt, x, y, args.dtype, scaler, found, inv)
            if not skip:
                opt.step()
            if i >= 10:
                times.append(clock() - start)
    finally:
        if not native:
            amp_patch.deinitialize()
    return statistics.median(times)


class _Loop(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(1))
        self.fn, self.calls, self.elapsed, self.clock = None, 0, 0.0, time.perf_counter

    def forward(self):
        start = self.clock()
        for _ in range(self.calls):
            self.fn()
        self.elapsed = self.clock() - start
        return self.p


def _per_call(variant, args, clock):
    x, w, b = torch.randn(8, 8), nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))

    def fn():
        return F.linear(x, w, b)

    def timed():
        start = clock()
        for _ in range(args.calls):
            fn()
        return (clock() - start) / args.calls * 1e6

    if variant in NATIVE:
        with torch.autocast("cpu", dtype=args.dtype):
            return timed(), None
    model = amp_patch.initialize(_Loop(), half_dtype=args.dtype, verbosity=0, **_options(variant, args))
    try:
        model.fn, model.calls, model.clock = fn, args.calls, clock
        model()
        return model.elapsed / args.calls * 1e6, timed()
    finally:
        amp_patch.deinitialize()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--width", type=int, default=64, help="the MLP's width (512+: a compute-bound step)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--op-lists", default=None, help="op list of the O1 variants (default: initialize's)")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    print(machine_line() + f", clock {args.clock}, {args.rounds} rounds x {args.steps} steps")
    model, x, y = _mlp(args.width, args.batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    names = list(VARIANTS)
    steps, calls = {v: [] for v in names}, {v: [] for v in names}
    for r in range(args.rounds):
        for variant in names[r % len(names):] + names[:r % len(names)]:
            steps[variant].append(_steps(variant, model, opt, x, y, args, clock))
            calls[variant].append(_per_call(variant, args, clock))
    native = statistics.median(steps["native"])
    print(f"\n| MLP 3x{args.width}, batch {args.batch}, AdamW | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    print("| step us | " + " | ".join(f"{statistics.median(steps[v]) * 1e6:.0f}" for v in names) + " |")
    print("| step / native | " + " | ".join(f"{statistics.median(steps[v]) / native:.3f}" for v in names) + " |")
    per_call = [n for n in names if n not in STEP_ONLY]
    print("\n| F.linear 8x8 per call | " + " | ".join(per_call) + " |")
    print("|---|" + "---|" * len(per_call))
    base_call = [n for n, _ in calls["native"]]
    for where, index in (("inside a forward", 0), ("outside", 1)):
        cells = []
        for v in names:
            if v in STEP_ONLY:
                continue
            col = base_call if v == "native" else [c[index] for c in calls[v]]
            ratio = statistics.median(o / n for o, n in zip(col, base_call))
            cells.append(f"{statistics.median(col):.2f} us ({ratio:.2f}x)")
        print(f"| {where} | " + " | ".join(cells) + " |")
    print(f"\nload after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
