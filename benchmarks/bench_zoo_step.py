"""Step time of the zoo's real architectures (tests/zoo.py: transformers GPT-2, BERT, T5, Llama, ViT, Whisper, torch
encoders, a ResNet, an LSTM; tiny configs, built with no download) under native autocast, amp_patch O1 and O2, and
a hand-written O2 step.

Usage: python benchmarks/bench_zoo_step.py [--rounds 3] [--steps 40] [--models bert-eager,llama-sdpa,...]
                                           [--dtype bfloat16|float16] [--clock thread|wall]

Needs the test extras (``transformers``). Each round builds each model once and runs every variant (order rotated)
on that build and one AdamW for ``--steps`` steps after 5 warm-up steps, 1 thread (where tensors land in memory moves
a step by up to 10-40% between builds, which per-variant builds turned into ratio noise; amp_patch is undone and hand
O2's buffer casts put back after each variant); a step figure is the median over rounds of each round's median
step, a ratio the median over rounds of that round's ratio (one build), every ratio taken in this run only.

"hand O2" is the least an O2 step does, written inline with no amp_patch: the zoo's O2 reference (buffers cast once;
each step every param outside batchnorm cast with ``p.to(half)`` into its module for the forward and the backward,
inputs cast to half, outputs to fp32), then one fused inf/NaN check of the grads and the step. It runs the same
kernels in the same dtypes as amp_patch's O2, so **O2 / hand O2 is amp_patch's own cost**. O2 / native also holds the
dtype difference (O2 runs layer norms, softmaxes and activations in half, native autocast in fp32): on a CPU
without bf16/fp16 instructions half kernels are slow and that part dominates. Prints the machine line (CPU flags).
Nothing here is asserted in tests.
"""
import argparse
import os
import statistics
import sys
import time

import torch

import amp_patch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests import zoo  # noqa: E402

try:
    from bench_bf16_hw import machine_line
except ImportError:  # run from elsewhere
    from benchmarks.bench_bf16_hw import machine_line

MODELS = ("gpt2-eager", "bert-eager", "t5-eager", "llama-sdpa", "vit-sdpa", "whisper-eager", "encoder", "resnet",
          "lstm-seq2seq")
VARIANTS = ("native", "O1", "O2", "hand O2")


def _hand_o2_step(case, model, batch, dtype, optimizer, found, inv):
    with zoo._step_casts(model, "O2", dtype):
        out = zoo._tree(zoo._call(model, zoo._cast_inputs(batch, dtype)), lambda t: t.float())
        loss = case.loss_fn(out, batch).float()
        loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    found.zero_()
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    if not found.item():
        optimizer.step()


def _amp_step(case, model, batch, optimizer):
    loss = case.loss_fn(zoo._call(model, batch), batch).float()
    with amp_patch.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


def _native_step(case, model, batch, dtype, optimizer):
    with torch.autocast("cpu", dtype=dtype):
        loss = case.loss_fn(zoo._call(model, batch), batch).float()
    loss.backward()
    optimizer.step()


def _steps(case, optimizer, variant, args, clock):
    model, dtype = case.model, args.dtype
    found, inv = torch.zeros(1), torch.ones(1)
    buffers = []
    if variant == "hand O2":
        buffers = [(b, b.data) for b in model.buffers()]
        zoo._cast_buffers(model, dtype)
    elif variant != "native":
        model, optimizer = amp_patch.initialize(model, optimizer, opt_level=variant, half_dtype=dtype, verbosity=0)
    batches = zoo._batches(case, 4)
    times = []
    try:
        for i in range(args.steps + 5):
            batch, start = batches[i % 4], clock()
            optimizer.zero_grad(set_to_none=True)
            if variant == "native":
                _native_step(case, model, batch, dtype, optimizer)
            elif variant == "hand O2":
                _hand_o2_step(case, model, batch, dtype, optimizer, found, inv)
            else:
                _amp_step(case, model, batch, optimizer)
            if i >= 5:
                times.append(clock() - start)
    finally:
        if variant in ("O1", "O2"):
            amp_patch.deinitialize()
        for buffer, data in buffers:
            buffer.data = data
    return statistics.median(times) * 1e6


def _ratio(runs, a, b):
    """Each round's pair, on that round's build: the median over rounds of the ratio."""
    return statistics.median(x / y for x, y in zip(runs[a], runs[b]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    print(machine_line() + f", clock {args.clock}, {args.rounds} rounds x {args.steps} steps, {args.dtype}")
    print("\n| model | native step us | O1 / native | O2 / native | hand O2 / native | O2 / hand O2 |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        runs = {v: [] for v in VARIANTS}
        try:
            for r in range(args.rounds):
                case = zoo._build(name)
                optimizer = torch.optim.AdamW(case.model.parameters(), lr=1e-4)
                for variant in VARIANTS[r % 4:] + VARIANTS[:r % 4]:
                    runs[variant].append(_steps(case, optimizer, variant, args, clock))
        except RuntimeError as exc:  # (CPU bf16 LSTM under native autocast: oneDNN has no primitive for it)
            print(f"| {name} | {variant} failed: {str(exc).splitlines()[0][:80]} | | | | |", flush=True)
            continue
        cells = [f"{_ratio(runs, a, b):.3f}" for a, b in (("O1", "native"), ("O2", "native"), ("hand O2", "native"),
                                                            ("O2", "hand O2"))]
        print(f"| {name} | {statistics.median(runs['native']):.0f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
