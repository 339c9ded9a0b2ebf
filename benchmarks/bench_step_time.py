"""Training-step time of amp_patch O1/O2 vs native torch.autocast, measured interleaved in one process,
and a cast-count check (O1 casts each weight used in half precision exactly once per iteration).

Usage: python benchmarks/bench_step_time.py [--quick] [--dtype bfloat16|float16] [--device cpu|cuda]
                                            [--rounds 5] [--steps 10] [--case mlp ...]
Each round runs every variant (order rotated per round) on a fresh copy of the model: amp_patch is
initialized and deinitialized per round. Medians are over all timed steps of all rounds. The machine's
speed drifts, so only the ratios measured in the same run mean anything. On a CPU without bf16/fp16
hardware the half kernels are slow: read the ratios to native autocast, not to fp32. Targets (not
asserted): O1/native <= 1.02 on mlp and encoder, <= 1.05 on tiny_transformer; O2 <= O1.
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

from amp_patch.tools.experiment.variants import CastCounter, make_variant

VARIANTS = ("native", "O1", "O2", "O0")  # O0: the fp32 baseline
TARGETS = {"mlp": 1.02, "encoder": 1.02, "tiny_transformer": 1.05}


class TinyTransformer(nn.Module):
    def __init__(self, vocab=256, d_model=64, seq=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.pos)).flatten(0, 1)


def _mlp_case():
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    x, y = torch.randn(64, 512), torch.randint(0, 512, (64,))
    return model, x, lambda out: F.cross_entropy(out, y)


def _encoder_case():
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(16, 64, 256)
    return model, x, lambda out: out.float().pow(2).mean()


def _tiny_transformer_case():
    tokens = torch.randint(0, 256, (8, 32))
    target = ((tokens + 1) % 256).flatten()
    return TinyTransformer(), tokens, lambda out: F.cross_entropy(out, target)


CASES = {"mlp": ("MLP 3x512, batch 64", _mlp_case),
         "encoder": ("TransformerEncoder 2 layers, d256, seq 64, batch 16", _encoder_case),
         "tiny_transformer": ("tiny transformer d64, 2 layers, seq 32, batch 8", _tiny_transformer_case)}


def _step(model, opt, runner, x, loss_fn):
    opt.zero_grad(set_to_none=True)
    with runner.forward_context():
        loss = loss_fn(model(x))
    runner.backward_and_step(loss, opt)
    return loss


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_round(base, x, loss_fn, variant, args, device):
    """Fresh copy, initialize, warm up, time ``args.steps`` steps, deinitialize; a list of ms per step."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    runner = make_variant(variant, args.half_dtype, args.device)
    model, opt = runner.setup(model, opt)
    times = []
    try:
        for i in range(args.warmup + args.steps):
            _sync(device)
            start = time.perf_counter()
            _step(model, opt, runner, x, loss_fn)
            _sync(device)
            if i >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3)
    finally:
        runner.close()
    return times


def measure(case, args):
    device = torch.device(args.device)
    torch.manual_seed(0)
    base, x, loss_fn = CASES[case][1]()
    base, x = base.to(device), x.to(device)
    times = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for variant in order:
            times[variant] += _time_round(base, x, loss_fn, variant, args, device)
    return {v: statistics.median(t) for v, t in times.items()}


def cast_counts(case, args, variant):
    """(weight casts in one iteration, distinct weights cast, all aten._to_copy calls) under ``variant``."""
    torch.manual_seed(0)
    model, x, loss_fn = CASES[case][1]()
    model, x = model.to(args.device), x.to(args.device)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)
    runner = make_variant(variant, args.half_dtype, args.device)
    model, opt = runner.setup(model, opt)
    try:
        _step(model, opt, runner, x, loss_fn)  # warm-up (lazy state)
        counter = CastCounter(params)
        with counter:
            _step(model, opt, runner, x, loss_fn)
    finally:
        runner.close()
    return len(counter.param_casts), len(set(counter.param_casts)), counter.casts


def _machine(args):
    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else (platform.processor() or platform.machine())
    return (f"{dev}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{args.dtype}, {args.rounds} rounds x {args.steps} steps")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--case", action="append", choices=list(CASES))
    parser.add_argument("--quick", action="store_true", help="2 rounds x 3 steps, 1 warm-up step")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 3, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda, but torch.cuda.is_available() is False (torch {torch.__version__}); "
                     "use --device cpu")
    args.half_dtype = getattr(torch, args.dtype)
    cases = args.case or list(CASES)
    print(f"Machine: {_machine(args)}\n")
    print("| case | fp32 ms | native ms | O1 ms | O2 ms | O1/native | O2/native | O2/O1 | fp32/O1 (speed-up) | "
          "O1/native target |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        m = measure(case, args)
        print(f"| {CASES[case][0]} | {m['O0']:.2f} | {m['native']:.2f} | {m['O1']:.2f} | {m['O2']:.2f} | "
              f"{m['O1'] / m['native']:.3f} | {m['O2'] / m['native']:.3f} | {m['O2'] / m['O1']:.3f} | "
              f"{m['O0'] / m['O1']:.3f} | <= {TARGETS[case]} |", flush=True)
    print("\nCast count (one forward+backward+step, weights cast from the fp32 parameters):\n")
    print("| case | O1 weight casts | distinct weights cast (O1) | distinct weights cast (native) | "
          "all _to_copy O1 / native | check |")
    print("|---|---|---|---|---|---|")
    for case in cases:
        o1_casts, o1_distinct, o1_all = cast_counts(case, args, "O1")
        _, nat_distinct, nat_all = cast_counts(case, args, "native")
        ok = o1_casts == o1_distinct == nat_distinct
        print(f"| {CASES[case][0]} | {o1_casts} | {o1_distinct} | {nat_distinct} | {o1_all} / {nat_all} | "
              f"{'ok' if ok else 'MISMATCH'} |", flush=True)


if __name__ == "__main__":
    main()
