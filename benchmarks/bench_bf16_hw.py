"""Step time where bf16 is fast: amp_patch O1/O2 vs native torch.autocast on a CPU with bf16 instructions.

Usage: python benchmarks/bench_bf16_hw.py [--rounds 5] [--steps 5] [--case mlp|block] [--clock wall|thread] [--profile]

Cases: MLP 4 x (Linear(1024) + GELU) + Linear(1024, 10), batch 256; a transformer block (d 512, 8 heads,
seq 128, batch 16). AdamW, bfloat16, 1 thread. Each round runs every variant (order rotated) on a fresh copy
of the model (amp_patch initialized and deinitialized per round); medians over all timed steps. Ratios
measured in the same run are what count. ``--clock thread`` times each step by the CPU time of the stepping thread
(``time.thread_time``; 1 intra-op thread, so all of the step's work runs on it): on a machine shared with other
processes it leaves out the time the step waited for a core, which wall time counts.
``--profile`` adds torch.profiler's per-op totals over 5 steps (copies,
the non-finite check). Prints the CPU's half-precision flags and the load average.
"""
import argparse
import copy
import os
import platform
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

import amp_patch

# variant -> initialize keywords (None: native torch.autocast, "fp32": no mixed precision)
VARIANTS = {"fp32": "fp32", "native": None, "O1": {"opt_level": "O1"},
            "O1 apex list": {"opt_level": "O1", "op_lists": "apex"},
            "O1 torch_cpu list": {"opt_level": "O1", "op_lists": "torch_cpu"}, "O2": {"opt_level": "O2"}}
_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "avx512f", "avx2")


def cpu_flags():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return [f for f in _FLAGS if f in flags]


def machine_line():
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return (f"Machine: {model}, {os.cpu_count()} CPUs, flags {' '.join(cpu_flags()) or '-'}, torch "
            f"{torch.__version__}, {torch.get_num_threads()} thread(s), load {os.getloadavg()}")


class Block(nn.Module):
    def __init__(self, d=512, heads=8):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                                activation="gelu", norm_first=True)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.layer(x)[:, 0])


def _mlp():
    layers = []
    for _ in range(4):
        layers += [nn.Linear(1024, 1024), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10)), torch.randn(256, 1024), torch.randint(0, 10, (256,))


def _block():
    return Block(), torch.randn(16, 128, 512), torch.randint(0, 10, (16,))


CASES = {"mlp": ("MLP 4x(Linear(1024)+GELU)+Linear(1024,10), batch 256", _mlp),
         "block": ("transformer block d512, 8 heads, seq 128, batch 16", _block)}


class Runner:
    def __init__(self, variant, dtype):
        self.kwargs, self.dtype = VARIANTS[variant], dtype

    def setup(self, model, opt):
        if isinstance(self.kwargs, dict):
            return amp_patch.initialize(model, opt, half_dtype=self.dtype, verbosity=0, **self.kwargs)
        return model, opt

    def step(self, model, opt, x, y):
        opt.zero_grad(set_to_none=True)
        if self.kwargs is None:
            with torch.autocast("cpu", dtype=self.dtype):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        elif self.kwargs == "fp32":
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        else:
            loss = F.cross_entropy(model(x), y)
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()

    def close(self):
        if isinstance(self.kwargs, dict):
            amp_patch.deinitialize()


def _round(base, x, y, variant, args, profile=False):
    model = copy.deepcopy(base)
    runner = Runner(variant, args.dtype)
    model, opt = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    times = []
    try:
        for _ in range(args.warmup):
            runner.step(model, opt, x, y)
        if profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    runner.step(model, opt, x, y)
            return prof.key_averages()
        clock = time.thread_time if args.clock == "thread" else time.perf_counter
        for _ in range(args.steps):
            start = clock()
            runner.step(model, opt, x, y)
            times.append((clock() - start) * 1e3)
    finally:
        runner.close()
    return times


def measure(case, args):
    torch.manual_seed(0)
    base, x, y = CASES[case][1]()
    names = list(VARIANTS)
    times = {v: [] for v in names}
    for r in range(args.rounds):
        for variant in names[r % len(names):] + names[:r % len(names)]:
            times[variant] += _round(base, x, y, variant, args)
    return {v: statistics.median(t) for v, t in times.items()}


def profile(case, args):
    torch.manual_seed(0)
    base, x, y = CASES[case][1]()
    print(f"\nProfile, {CASES[case][0]}, 5 steps:\n")
    print("| variant | total ms | aten::copy_ calls | aten::copy_ ms | non-finite check ms | _foreach_copy_ ms |")
    print("|---|---|---|---|---|---|")
    for variant in VARIANTS:
        if variant == "fp32":
            continue
        avg = {e.key: e for e in _round(base, x, y, variant, args, profile=True)}
        total = sum(e.self_cpu_time_total for e in avg.values()) / 1e3

        def ms(key, avg=avg):
            return avg[key].cpu_time_total / 1e3 if key in avg else 0.0

        copies = avg["aten::copy_"].count if "aten::copy_" in avg else 0
        print(f"| {variant} | {total:.1f} | {copies} | {ms('aten::copy_'):.1f} | "
              f"{ms('aten::_amp_foreach_non_finite_check_and_unscale_'):.1f} | {ms('aten::_foreach_copy_'):.1f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--case", action="append", choices=list(CASES))
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="wall: time.perf_counter; thread: CPU time of the stepping thread (shared machines)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    args.dtype = torch.bfloat16
    torch.set_num_threads(1)
    print(machine_line() + f", clock {args.clock}")
    cases = args.case or list(CASES)
    print("\n| case | fp32 ms | native ms | " + " | ".join(f"{v}/native" for v in VARIANTS if v != "native")
          + " |")
    print("|---|---|---|" + "---|" * (len(VARIANTS) - 1))
    for case in cases:
        m = measure(case, args)
        print(f"| {CASES[case][0]} | {m['fp32']:.1f} | {m['native']:.1f} | "
              + " | ".join(f"{m[v] / m['native']:.3f}" for v in VARIANTS if v != "native") + " |", flush=True)
    if args.profile:
        for case in cases:
            profile(case, args)
    print(f"\nload after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
