"""Deterministic per-step costs of the zoo's real architectures: Python frames and torch's slow module calls.

Usage: python benchmarks/bench_zoo_frames.py [--models bert-eager,...] [--dtype bfloat16|float16]

Time on a small shared VM is noisy (see bench_ab_step.py); the Python work a step adds is not. For each model
(tests/zoo.py, built once) and each of native autocast, O1 and O2, one steady step (after 3 warm-up steps) is
profiled with ``sys.setprofile``: "frames" counts the Python function calls the step made (amp_patch's in
brackets), "slow calls" the module calls that took torch's slow call path (``_call_impl``'s nested ``inner``,
which runs hooks; with no hook a module call is one bytecode-level check). Compare two trees of amp_patch by
running this with each on ``PYTHONPATH``. Nothing here is asserted in tests.
"""
import argparse
import os
import sys

import torch

import amp_patch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests import zoo  # noqa: E402

MODELS = ("gpt2-eager", "bert-eager", "t5-eager", "llama-sdpa", "vit-sdpa", "whisper-eager", "encoder", "resnet",
          "lstm-seq2seq")
_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _count(step):
    counts = {"frames": 0, "amp_patch": 0, "slow": 0}

    def profile(frame, event, arg):
        if event != "call":
            return
        counts["frames"] += 1
        code = frame.f_code
        if "amp_patch" in code.co_filename:
            counts["amp_patch"] += 1
        elif code.co_name == "inner" and frame.f_back is not None and frame.f_back.f_code is _CALL_IMPL:
            counts["slow"] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return counts


def _measure(name, variant, dtype):
    torch.manual_seed(0)
    case = zoo._build(name)
    model = case.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant != "native":
        model, optimizer = amp_patch.initialize(model, optimizer, opt_level=variant, half_dtype=dtype, verbosity=0)
    batch = zoo._batches(case, 1)[0]

    def step():
        optimizer.zero_grad(set_to_none=True)
        if variant == "native":
            with torch.autocast("cpu", dtype=dtype):
                loss = case.loss_fn(zoo._call(model, batch), batch).float()
            loss.backward()
        else:
            loss = case.loss_fn(zoo._call(model, batch), batch).float()
            with amp_patch.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        optimizer.step()

    try:
        for _ in range(3):
            step()
        return _count(step)
    finally:
        if variant != "native":
            amp_patch.deinitialize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    print(f"amp_patch from {os.path.dirname(amp_patch.__file__)}, torch {torch.__version__}, {args.dtype}\n")
    print("| model | native frames | O1 frames (amp_patch) | O2 frames (amp_patch) | slow calls native / O1 / O2 |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        got = {variant: _measure(name, variant, dtype) for variant in ("native", "O1", "O2")}
        print(f"| {name} | {got['native']['frames']} | {got['O1']['frames']} ({got['O1']['amp_patch']}) | "
              f"{got['O2']['frames']} ({got['O2']['amp_patch']}) | "
              f"{got['native']['slow']} / {got['O1']['slow']} / {got['O2']['slow']} |")


if __name__ == "__main__":
    main()
