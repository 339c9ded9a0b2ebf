"""Bytes per parameter of fp32 training, O2 (the fp32 params are the masters; half compute copies per forward), O2
in the two-copy layout of the apex alias (half params, fp32 masters in the optimizer) and O2 with remainder masters
(bf16 + int16), with
SGD-momentum and AdamW, and the step time of remainder masters relative to fp32-master O2.

Usage: python benchmarks/bench_o2_memory.py [--width 1024] [--layers 4] [--batch 32] [--steps 6] [--rounds 3]

Bytes are counted from tensor storages, not RSS: every distinct storage (by data pointer) of the model's params
and grads, the optimizer's params (the masters under O2) and grads, its state, and amp_patch's remainders, divided
by the model's parameter count. Columns:

* ``between``: after ``optimizer.step(); optimizer.zero_grad()`` (torch's default ``set_to_none=True``);
* ``between (grads kept)``: the same with ``zero_grad(set_to_none=False)``, so zeroed grads stay allocated;
* ``before step``: after the backward (the grads of this step alive);
* ``in step``: inside ``step()`` just before the optimizer runs (amp_patch's pre-step hook done: remainder
  masters joined). The optimizer's own temporaries come on top of this and are the same in every column of a
  row's optimizer (the same optimizer runs on fp32 tensors in all three).

Step time: median seconds of a whole training step (forward, backward, step, zero_grad), the variants
interleaved round by round on fresh models; and of ``optimizer.step()`` from after amp_patch's pre-step hook
(remainder masters joined) to after its post-step hook (split back): the optimizer plus the split. Target:
remainder / fp32-master O2 <= 1.10 for the whole step. Nothing is asserted.
"""
import argparse
import statistics
import time

import torch
from torch import nn

import amp_patch
from amp_patch.legacy.stacking import open_apex_session

VARIANTS = ("fp32", "O2", "O2-two-copy", "O2-remainder")  # O2-two-copy: the apex alias's layout (masters apart)
OPTIMIZERS = {"sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01)}


def make_model(width, layers):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*mods[:-1])


def setup(variant, opt_name, width, layers):
    model = make_model(width, layers)
    opt = OPTIMIZERS[opt_name](model.parameters())
    if variant != "fp32":
        masters = "remainder" if variant == "O2-remainder" else True
        options = dict(opt_level="O2", half_dtype=torch.bfloat16, master_weights=masters, verbosity=0)
        if variant == "O2-two-copy":  # the layout the apex alias keeps (Apex's rules: Properties.api == "apex")
            model, opt = open_apex_session(model, opt, options)
        else:
            model, opt = amp_patch.initialize(model, opt, **options)
    return model, opt


def tensors_held(model, opt):
    """Every tensor the training state holds (model, optimizer, amp_patch's remainders)."""
    found = []
    for p in list(model.parameters()) + [p for g in opt.param_groups for p in g["params"]]:
        found += [p, p.grad]
    for state in opt.state.values():
        found += [v for v in state.values() if torch.is_tensor(v)]
    session = amp_patch.session.api._state.current()
    if session is not None:
        for opt_state in session.scaling.opt_states.values():
            found += list(getattr(opt_state.storage, "remainders", {}).values())
    return [t for t in found if t is not None]


def bytes_held(model, opt):
    storages = {}
    for t in tensors_held(model, opt):
        s = t.untyped_storage()
        storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
    return sum(storages.values())


def batch(width, size, step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(size, width, generator=gen), torch.randn(size, width, generator=gen)


def train_step(model, opt, variant, x, y, set_to_none=True, count=True):
    half = variant != "fp32"
    out = model(x.to(torch.bfloat16) if half else x).float()
    loss = nn.functional.mse_loss(out, y)
    if half:
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
    else:
        loss.backward()
    before = bytes_held(model, opt) if count else None
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    return before


def measure_bytes(variant, opt_name, args):
    model, opt = setup(variant, opt_name, args.width, args.layers)
    try:
        n = sum(p.numel() for p in model.parameters())
        inside = []
        handle = opt.register_step_pre_hook(lambda o, a, k: inside.append(bytes_held(model, o)))
        for step in range(2):  # the optimizer's state exists from the first step on
            before = train_step(model, opt, variant, *batch(args.width, args.batch, step))
        between = bytes_held(model, opt)
        train_step(model, opt, variant, *batch(args.width, args.batch, 2), set_to_none=False)
        kept = bytes_held(model, opt)
        handle.remove()
        return n, {"between": between / n, "between (grads kept)": kept / n, "before step": before / n,
                   "in step": inside[-1] / n}
    finally:
        amp_patch.deinitialize()


def measure_time(opt_name, args, variants=("O2", "O2-remainder")):
    """Median whole-step and step()-only seconds per variant, variants interleaved round by round."""
    whole, step_only = {v: [] for v in variants}, {v: [] for v in variants}
    for r in range(args.rounds):
        for variant in variants[r % 2:] + variants[:r % 2]:
            model, opt = setup(variant, opt_name, args.width, args.layers)
            try:
                # the hooks run within each step's iteration and must see that step's fresh ``marks``
                opt.register_step_pre_hook(lambda o, a, k: marks.append(time.perf_counter()))  # noqa: B023
                opt.register_step_post_hook(lambda o, a, k: marks.append(time.perf_counter()))  # noqa: B023
                for step in range(args.steps + 1):
                    marks = []
                    start = time.perf_counter()
                    train_step(model, opt, variant, *batch(args.width, args.batch, step), count=False)
                    if step:  # the first step builds the optimizer's state
                        whole[variant].append(time.perf_counter() - start)
                        step_only[variant].append(marks[1] - marks[0])
            finally:
                amp_patch.deinitialize()
    return ({v: statistics.median(t) for v, t in whole.items()},
            {v: statistics.median(t) for v, t in step_only.items()})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = sum(p.numel() for p in make_model(args.width, args.layers).parameters())
    print(f"model: {args.layers} x Linear({args.width}, {args.width}), {n / 1e6:.2f}M params, batch {args.batch}")
    columns = ("between", "between (grads kept)", "before step", "in step")
    print("| optimizer | variant | " + " | ".join(f"{c} B/param" for c in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for opt_name in OPTIMIZERS:
        for variant in VARIANTS:
            _, figures = measure_bytes(variant, opt_name, args)
            print(f"| {opt_name} | {variant} | " + " | ".join(f"{figures[c]:.2f}" for c in columns) + " |")
    print("\n| optimizer | O2 step s | O2-remainder step s | ratio | O2 step() s | O2-remainder step() s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for opt_name in OPTIMIZERS:
        whole, step_only = measure_time(opt_name, args)
        print(f"| {opt_name} | {whole['O2']:.4f} | {whole['O2-remainder']:.4f} | "
              f"{whole['O2-remainder'] / whole['O2']:.3f} | {step_only['O2']:.4f} | "
              f"{step_only['O2-remainder']:.4f} | {step_only['O2-remainder'] / step_only['O2']:.3f} |")


if __name__ == "__main__":
    main()
