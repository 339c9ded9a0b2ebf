"""Random small programs through Apex's amp API, run by any ``amp`` module (real ``apex.amp`` or amp_patch's alias).

A program (:func:`draw`, from a seed) picks an opt level (O0 with a dynamic or static scale, O2, O3), one or two
models with one or two optimizers (SGD with momentum, Adam) and ``num_losses`` loss ids, static/dynamic scales
and bounds, then steps of one to three micro-batches (``delay_unscale`` accumulation, injected inf losses),
master-param clipping, ``amp.state_dict()`` round trips and ``zero_grad`` before or after the step.
:func:`run` returns a trace ``[(label, value)]``: every loss, each scaler's scale and ``_unskipped`` after each
step, every model and master param. This module imports only torch: the real-Apex child imports it too.
"""
import random

import torch
import torch.nn.functional as F

PROFILES = {"fast": 24, "long": 300}
STEPS = 4


def draw(seed):
    rng = random.Random(seed)
    level = rng.choice(["O0", "O2", "O3"])
    scale = rng.choice([None, "dynamic", 128.0])
    n_models = rng.choice([1, 2])
    program = {"seed": seed, "opt_level": level, "loss_scale": scale, "n_models": n_models,
               "n_losses": rng.choice([1, n_models]) if n_models == 2 else 1,
               "shared_optimizer": rng.random() < 0.5,
               "optim": rng.choice(["sgd", "adam"] if level != "O3" else ["sgd"]),  # (O3: Adam's eps is 0 in fp16)
               "bounds": rng.choice([{}, {"min_loss_scale": 2.0 ** 14}, {"max_loss_scale": 2.0 ** 17}]),
               "zero_grad": rng.choice(["before", "after"]), "steps": []}
    dynamic = scale == "dynamic" or (scale is None and level == "O2")
    if not dynamic:
        program["bounds"] = {}
    for _ in range(STEPS):
        n = rng.choice([1, 2, 3])
        program["steps"].append({
            "micro": [{"delay": k < n - 1 and rng.random() < 0.5,
                       "inf": dynamic and rng.random() < 0.2} for k in range(n)],
            "clip": rng.random() < 0.3, "round_trip": rng.random() < 0.2})
    return program


def known_difference(program):
    """Why amp_patch deliberately differs from Apex on ``program`` (docs/migration.md), or None."""
    for step in program["steps"]:
        flags = [m["delay"] for m in step["micro"]]
        if any(flags[k] and not all(flags[:k]) for k in range(len(flags))):
            return ("a delay_unscale micro-batch after an unscaled one in the same step: Apex unscaled the "
                    "earlier micro-batch's grads a second time")
    dynamic = program["loss_scale"] == "dynamic" or (program["loss_scale"] is None and program["opt_level"] == "O2")
    if dynamic and program["n_models"] == 2 and _delayed_then_changed(program):
        return ("delay_unscale grads pending while a scale changed (an overflow: two losses on one optimizer whose "
                "scalers now differ, or one scaler shared by two optimizers): Apex unscaled them by the scale of the "
                "exit, not the one they carry")
    return None


def _delayed_then_changed(program):
    """A delayed micro-batch where a scale may have changed before its grads are unscaled: after an overflow (two
    losses, one optimizer), or before a later unscaling exit in its step (one loss, two optimizers; an O2 half
    grad may overflow without an inf loss)."""
    inf_seen = False
    for step in program["steps"]:
        micro = step["micro"]
        for k, m in enumerate(micro):
            if m["delay"] and program["n_losses"] == 2 and program["shared_optimizer"] and (inf_seen or any(
                    x["inf"] for x in micro[:k])):
                return True
            if m["delay"] and program["n_losses"] == 1 and not program["shared_optimizer"] and not all(
                    x["delay"] for x in micro[k:]):
                return True
        inf_seen |= any(m["inf"] for m in micro)
    return False


def describe(program):
    steps = "; ".join(",".join(("d" if m["delay"] else "") + ("inf" if m["inf"] else "ok") for m in s["micro"])
                      + (" clip" if s["clip"] else "") + (" sd" if s["round_trip"] else "")
                      for s in program["steps"])
    keys = ("seed", "opt_level", "loss_scale", "n_models", "n_losses", "shared_optimizer", "optim", "bounds",
            "zero_grad")
    return " ".join(f"{k}={program[k]!r}" for k in keys) + f" steps: {steps}"


def _build(program):
    torch.manual_seed(program["seed"])
    models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
              for _ in range(program["n_models"])]
    with torch.no_grad():  # weights a half can hold: Apex's O2 masters (the half weights widened) are then exact
        for p in (p for m in models for p in m.parameters()):
            p.copy_(p.half().float())

    def make(params):
        if program["optim"] == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.Adam(params, lr=1e-3)
    if program["shared_optimizer"] or program["n_models"] == 1:
        optimizers = [make([p for m in models for p in m.parameters()])]
    else:
        optimizers = [make(m.parameters()) for m in models]
    return models, optimizers


def _initialize(amp, program, models, optimizers):
    kwargs = dict(opt_level=program["opt_level"], num_losses=program["n_losses"], verbosity=0, **program["bounds"])
    if program["loss_scale"] is not None:
        kwargs["loss_scale"] = program["loss_scale"]
    return amp.initialize(models, optimizers, **kwargs)


def _micro_batch(amp, program, models, optimizers, micro, tag, trace):
    for i, model in enumerate(models):
        x, y = torch.randn(4, 4), torch.randn(4, 2)
        loss = F.mse_loss(model(x).float(), y)
        if micro["inf"] and i == 0:
            loss = loss * float("inf")
        trace.append((f"{tag} model {i} loss", loss.item()))
        opts = optimizers if len(optimizers) == 1 else [optimizers[i]]
        loss_id = i if program["n_losses"] == 2 else 0
        with amp.scale_loss(loss, opts, loss_id=loss_id, delay_unscale=micro["delay"]) as scaled:
            scaled.backward()


def _step(amp, program, models, optimizers, s, step, trace):
    if program["zero_grad"] == "before":
        for opt in optimizers:
            opt.zero_grad()
    for k, micro in enumerate(step["micro"]):
        torch.manual_seed(1000 * program["seed"] + 10 * s + k)
        _micro_batch(amp, program, models, optimizers, micro, f"step {s} micro {k}", trace)
    if step["clip"]:
        for opt in optimizers:
            torch.nn.utils.clip_grad_norm_(list(amp.master_params(opt)), 1.0)
    for opt in optimizers:
        opt.step()
    if program["zero_grad"] == "after":
        for opt in optimizers:
            opt.zero_grad()
    if step["round_trip"]:
        amp.load_state_dict(amp.state_dict())


def _record(amp, program, models, optimizers, tag, trace):
    for i, scaler in enumerate(amp._amp_state.loss_scalers):
        trace.append((f"{tag} scaler {i}", (float(scaler.loss_scale()), int(scaler._unskipped))))
    half = program["opt_level"] in ("O2", "O3")
    for i, model in enumerate(models):  # O2/O3: the half weights (amp_patch's state_dict has the fp32 masters)
        for name, value in model.state_dict().items():
            trace.append((f"{tag} model {i} {name}", value.detach().half() if half else value.detach().clone()))
    for i, opt in enumerate(optimizers):
        for j, p in enumerate(amp.master_params(opt)):
            trace.append((f"{tag} optimizer {i} master {j}", p.detach().clone()))


def run(amp, program):
    """The trace of ``program`` under ``amp``; an exception ends it with ``("raised", "Type: message")``."""
    trace = []
    models, optimizers = _build(program)
    try:
        models, optimizers = _initialize(amp, program, models, optimizers)
        for s, step in enumerate(program["steps"]):
            _step(amp, program, models, optimizers, s, step, trace)
            _record(amp, program, models, optimizers, f"after step {s}", trace)
    except Exception as exc:  # noqa: BLE001 - the trace records where a run raised
        trace.append(("raised", f"{type(exc).__name__}: {str(exc)[:200]}"))
    return trace


def run_all(amp, profile, count):
    if profile in ("nested", "zero_grad"):  # (fixed programs: apex_nested_programs, apex_zero_grad_programs)
        return __import__(f"apex_{profile}_programs").run_all(amp)
    return [run(amp, draw(seed)) for seed in range(count)]


def first_difference(apex, ours):
    """The first entry where two traces differ (bitwise; NaN equals NaN), or None."""
    for (label_a, a), (label_b, b) in zip(apex, ours):
        if label_a != label_b:
            return f"{label_a!r} vs {label_b!r}"
        if isinstance(a, torch.Tensor):
            same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(
                torch.equal(a, b) or torch.equal(torch.nan_to_num(a, 7.0, 8.0, 9.0),
                                                 torch.nan_to_num(b, 7.0, 8.0, 9.0)))
        else:
            same = a == b or (a != a and b != b)
        if not same:
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
                gap = (a.double() - b.double()).abs().max().item()
                return f"{label_a}: real Apex {a.dtype} vs amp_patch {b.dtype}, max |diff| {gap:.3g}"
            return f"{label_a}: real Apex {a!r} vs amp_patch {b!r}"
    if len(apex) != len(ours):
        return f"trace lengths differ: real Apex {len(apex)}, amp_patch {len(ours)}"
    return None
