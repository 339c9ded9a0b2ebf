"""From measurements to findings: one per cause that is there, each with its share of the step, where it happens,
the measured figure and a written fix, ranked by what they cost.

Findings whose cost this run cannot measure come first, with ``share`` None: ``hardware`` (no half-precision
hardware: no speed-up at all), then, on the CPU, ``data_parallel`` and ``host_sync`` (they cost nothing there yet,
and a step on a GPU waits for them); then the others by their share of the step time. A cause below its threshold
(:data:`THRESHOLDS`) is not reported.
"""
import dataclasses
import inspect
import os

import torch
from torch import nn

from .. import machine
from .shapes import MULTIPLE, misaligned, padded

#: the share of the step time from which a cause is reported
THRESHOLDS = {"data_loading": 0.15, "casts": 0.10, "optimizer": 0.25, "alignment": 0.01, "op_list_overhead": 0.05}
#: the least share of the step a measured fix must save to be printed
MIN_GAIN = 0.05
_FIRST = ("hardware", "data_parallel", "host_sync")


@dataclasses.dataclass
class Finding:
    """One cause: ``kind``, ``share`` of the step time (None where the cost is not a part of the step),
    ``where`` it happens, the measured ``figure`` and the ``fix``."""

    kind: str
    share: object
    where: str
    figure: str
    fix: str


@dataclasses.dataclass(frozen=True)
class Context:
    """What the findings need besides the measurements."""

    job: str  # the --job spec (MODULE:FUNCTION for a Job object), for the commands a fix names
    opt_level: str
    half_dtype: torch.dtype
    device: str
    machine: str = ""  # the machine line, with the thread count the steps ran with (``machine.describe``)

    @property
    def half(self):
        return self.opt_level != "O0"

    @property
    def cuda(self):
        return torch.device(self.device).type == "cuda"


def findings(m, ctx):
    """The ranked findings of measurements ``m``."""
    found = [f for make in (hardware, data_parallel, data_loading, host_sync, alignment, casts, op_list_overhead,
                            optimizer) if (f := make(m, ctx)) is not None]
    return sorted(found, key=_rank)


def _rank(finding):
    unmeasured = finding.share is None
    return (not unmeasured, _FIRST.index(finding.kind) if unmeasured else 0, -(finding.share or 0.0))


def _pct(share):
    return f"{share:.0%}" if share >= 0.01 else f"{share:.1%}"


def hardware(m, ctx):
    if not ctx.half:
        return None
    reading = machine.half_hardware(ctx.device, ctx.half_dtype)
    if reading.native:
        return None
    other = torch.bfloat16 if ctx.half_dtype == torch.float16 else torch.float16
    alt = machine.half_hardware(ctx.device, other)
    instead = (f"use half_dtype={other} (it runs on hardware here: {alt.evidence})" if alt.native else
               "stay with fp32 (O0) on this machine and use mixed precision where the hardware has it "
               "(a GPU of compute capability 7.0 or later, a CPU with AVX-512 BF16/AMX)")
    return Finding("hardware", None, f"{reading.device} ({ctx.machine or machine.describe(ctx.device)})",
                   reading.sentence() + ": no speed-up is possible from it",
                   f"{reading.dtype} cannot make this job faster on this machine: {instead}.")


def data_parallel(m, ctx):
    wrappers = [(n, mod) for n, mod in m.model.named_modules() if isinstance(mod, nn.DataParallel)]
    if not wrappers:
        return None
    name, wrapper = wrappers[0]
    label = name or "model"
    outer, inner = m.module_s.get(label, []), m.module_s.get(f"{name}.module" if name else "module", [])
    outside = m.per_step_ms([max(a - b, 0.0) for a, b in zip(outer, inner)])
    devices = len(wrapper.device_ids or [])
    share = outside / m.step_ms() if ctx.cuda else None
    return Finding("data_parallel", share, f"{label} ({type(wrapper).__name__} over {devices} device(s))",
                   "nn.DataParallel drives every device from one process: each step scatters the batch, "
                   "replicates the model and gathers the outputs" + (f" ({outside:.2f} ms per step here, "
                   f"{_pct(share)} of the step, outside the wrapped module)" if share is not None else
                   " (on the CPU it wraps nothing yet; on GPUs that costs every step)"),
                   "use torch.nn.parallel.DistributedDataParallel, one process per GPU (torchrun); amp_patch "
                   "supports it with every opt level (docs/distributed.md): initialize the model, then wrap it "
                   "in DDP.")


def data_loading(m, ctx):
    share = m.phase_share("data")
    if share < THRESHOLDS["data_loading"]:
        return None
    loader = m.loader
    workers = getattr(loader, "num_workers", None)
    wait = m.phase_ms_median("data")
    gain = m.loader_gain
    measured = ""
    if not workers:
        if gain is None or not gain.significant or gain.saved_ms / m.step_ms() < MIN_GAIN:
            return None  # workers measured no faster here (or not measurable): no fix to print
        measured = (f"; with num_workers={suggested_workers()} the same Dataset delivered a batch in "
                    f"{gain.after_ms:.2f} ms instead of {gain.before_ms:.2f} ms ({_pct(gain.saved_ms / m.step_ms())} "
                    f"of the step saved; measured: faster in every one of {gain.pairs} interleaved rounds, "
                    f"{gain.low:.2f}-{gain.high:.2f}x)")
    built = "the job's DataLoader" if m.loader is m.data else "the DataLoader the report built from the job's " \
        "Dataset (as the experiment does)"
    where = f"{built}: {_loader_text(loader)}"
    fix = (f"build the batches in worker processes: return a DataLoader from data_fn with "
           f"num_workers={suggested_workers()} (this machine has {os.cpu_count()} CPUs)" if not workers else
           f"the {workers} workers do not keep up: raise num_workers, or make the Dataset's __getitem__ cheaper "
           "(decode or augment once, ahead of training)")
    if ctx.cuda and not (getattr(loader, "pin_memory", False) and getattr(loader, "persistent_workers", False)):
        # untested: no CUDA on the machine this was written on
        fix += ", with pin_memory=True (faster, asynchronous copies to the GPU) and persistent_workers=True"
    return Finding("data_loading", share, where,
                   f"{wait:.2f} ms of each step waiting for the next batch ({_pct(share)} of the step time)"
                   + measured,
                   fix + ".")


def suggested_workers():
    """The num_workers a fix suggests: 4, or fewer on a machine with fewer CPUs."""
    return max(1, min(4, os.cpu_count() or 1))


def _loader_text(loader):
    if loader is None:
        return "unknown loader"
    dataset = getattr(loader, "dataset", None)
    source = ""
    getitem = getattr(type(dataset), "__getitem__", None)
    try:
        source = f" ({inspect.getsourcefile(getitem)}:{inspect.getsourcelines(getitem)[1]})"
    except (TypeError, OSError):
        pass
    return (f"{type(loader).__name__}(num_workers={getattr(loader, 'num_workers', '?')}, "
            f"pin_memory={getattr(loader, 'pin_memory', '?')}) over {type(dataset).__name__}{source}")


def host_sync(m, ctx):
    if not m.host_reads:
        return None
    per_step = sum(m.host_reads.values()) / m.probe_steps
    ranked = sorted(m.host_reads.items(), key=lambda item: -item[1])
    sites = ", ".join(f"{what} at {site} ({count / m.probe_steps:g}x)" for (site, what), count in ranked[:3])
    more = f" and {len(ranked) - 3} more" if len(ranked) > 3 else ""
    share = m.share(m.host_read_s) if ctx.cuda else None
    cuda = (f"; torch.cuda sync debug mode saw {m.cuda_syncs / m.probe_steps:g} syncs per step"
            if m.cuda_syncs is not None else "; on the CPU nothing waits, but on a GPU each one stalls until "
            "all queued work is done")
    return Finding("host_sync", share, ranked[0][0][0],
                   f"{per_step:g} host read(s) of tensor values per step: {sites}{more}{cuda}",
                   "keep values on the device inside the step: accumulate losses and metrics as tensors and read "
                   "them (.item(), print) every N steps, replace `if tensor:` by torch.where or masking, and "
                   "build tensors on the device rather than from Python numbers read back.")


_UNITS = {True: "tensor cores", False: "whole hardware tiles (on a GPU, its tensor cores)"}


def alignment(m, ctx):
    """Misaligned layers and matmuls whose padding was measured faster (every interleaved pair) on this machine."""
    if not ctx.half:
        return None
    gains = {key: g for key, g in m.padding.items() if g is not None and g.significant}
    saved = sum(g.saved_ms * _calls_per_step(m, key) for key, g in gains.items())
    share = min(saved / m.step_ms(), 1.0)  # (timed alone, the pieces can add up to more than the step)
    if not gains or share < THRESHOLDS["alignment"]:
        return None  # nothing measured to gain here: no fix to print
    dtype = str(ctx.half_dtype).removeprefix("torch.")
    modules = dict(m.model.named_modules())
    named, pads, sizes = [], [], set()
    for key in gains:
        if isinstance(key, str):
            bad = misaligned(modules[key])
            named.append(f"{key or 'model'} ({type(modules[key]).__name__}: "
                         + ", ".join(f"{attr}={size}" for attr, size, _ in bad) + ")")
            pads.append(f"{key or 'model'}: " + ", ".join(f"{attr} {size} -> {pad}" for attr, size, pad in bad))
            sizes.update(size for _, size, _ in bad)
        else:
            site, k, n = key
            named.append(f"matmul at {site} (k={k}, n={n})")
            pads.append(f"the matmul at {site}: " + ", ".join(
                f"{dim} {size} -> {padded(size)}" for dim, size in (("k", k), ("n", n)) if size % MULTIPLE))
            sizes.update(size for size in (k, n) if size % MULTIPLE)
    fields = config_fields(m.model, sizes)
    before = sum(g.before_ms * _calls_per_step(m, key) for key, g in gains.items())
    more = f" and {len(named) - 3} more" if len(named) > 3 else ""
    low, high = min(g.low for g in gains.values()), max(g.high for g in gains.values())
    where = "; ".join(named[:3]) + more + (f"; set by {', '.join(fields)}" if fields else "")
    return Finding("alignment", share, where,
                   f"padded as advised, their forward and backward in {dtype} took {before - saved:.2f} ms instead "
                   f"of {before:.2f} ms per step, {_pct(share)} of the step saved (measured on this machine: each "
                   f"padded piece faster in every one of its interleaved pairs, {low:.2f}-{high:.2f}x)",
                   f"pad the sizes to multiples of 8 so {dtype} matmuls use {_UNITS[bool(ctx.cuda)]}: "
                   + ("; ".join(f"set {field} -> {padded(int(field.split('=')[1].split(' ')[0]))} in the "
                                "model's config" for field in fields) + "; " if fields else "")
                   + "; ".join(pads[:3]) + more + " (pad a vocabulary or class count and ignore the extra outputs).")


def _calls_per_step(m, key):
    if isinstance(key, str):
        return m.module_calls.get(key, 0) / max(1, m.module_probe_steps) or 1.0
    return m.matmul_calls.get(key, 0) / max(1, m.probe_steps) or 1.0


def config_fields(model, sizes):
    """``field=value (where)`` of the model's configs (a ``config`` attribute with ``to_dict()``, as Hugging Face
    models have) whose integer value sets a misaligned size (the size itself, or up to 4 times it)."""
    found = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if not hasattr(config, "to_dict") or any(f.endswith(f"({name or 'model'}.config)") for f in found):
            continue
        for field, value in config.to_dict().items():
            if isinstance(value, int) and not isinstance(value, bool) and value > MULTIPLE and value % MULTIPLE \
                    and any(size % value == 0 and size // value <= 4 for size in sizes):
                found.append(f"{field}={value} ({name or 'model'}.config)")
    return list(dict.fromkeys(found))


def casts(m, ctx):
    if not ctx.half or not m.casts:
        return None
    share = m.share(m.cast_s)
    if share < THRESHOLDS["casts"]:
        return None
    weights = m.weight_casts / m.probe_steps
    fix = (f"{ctx.opt_level} casts each fp32 weight to half once per step ({weights:g} weight casts per step), "
           "as native autocast does: the price of keeping fp32 weights. Only O3 keeps the weights in half and "
           "casts none of them (no fp32 weights: check its loss against fp32 with `amp-patch experiment --job "
           f"{ctx.job} --variants fp32,{ctx.opt_level},O3`). " if ctx.opt_level in ("O1", "O2") and weights else "")
    fix += ("For activations cast back and forth, `amp-patch trace` shows which ops cast; an op list "
            "(initialize(op_lists=...)) that keeps neighbouring ops in one category removes the round trips: "
            "measure it again with `amp-patch speed`.")
    return Finding("casts", share, f"{ctx.opt_level} casting ({m.casts / m.probe_steps:g} casts per step)",
                   f"{m.per_step_ms(m.cast_s):.2f} ms of each step in dtype casts ({_pct(share)}), "
                   f"{m.casts / m.probe_steps:g} casts per step, {weights:g} of them of weights", fix)


def op_list_overhead(m, ctx):
    """amp_patch's own casting against native autocast on the same job, when measured slower in every round."""
    o = m.native
    if o is None or not o.significant:
        return None
    share = o.extra_ms / m.step_ms()
    if share < THRESHOLDS["op_list_overhead"]:
        return None
    native_list = "torch_cuda" if ctx.cuda else "torch_cpu"
    return Finding("op_list_overhead", share,
                   f"amp_patch's O1 casting ({o.amp_casts} casts per step; native torch.autocast: {o.native_casts})",
                   f"O1 took {o.amp_ms:.2f} ms per step against native torch.autocast's {o.native_ms:.2f} ms on the "
                   f"same model and batches: {o.extra_ms:.2f} ms ({_pct(share)} of the step) is the price of "
                   f"amp_patch's op-list casting (measured: slower in every one of {o.rounds} interleaved rounds, "
                   f"{o.low:.2f}-{o.high:.2f}x)",
                   f"fewer casts: use the native list, initialize(..., op_lists='{native_list}') (native autocast's "
                   "own choices; the apex alias and a list extending 'apex' cast more), and keep neighbouring ops in "
                   f"one category where `amp-patch trace --job {ctx.job}` shows round trips; where no op list of your "
                   "own is needed, train with torch.autocast itself (the experiment's `native` variant measures it "
                   "against O1 on your job).")


def optimizer(m, ctx):
    share = m.phase_share("optimizer")
    if share < THRESHOLDS["optimizer"]:
        return None
    opt = m.optimizer
    name = type(opt).__name__
    params = inspect.signature(type(opt).__init__).parameters
    options = opt.defaults
    if "fused" in params and not options.get("fused"):
        fix = f"torch.optim.{name}(..., fused=True) runs the whole update as one kernel per dtype and device"
    elif "foreach" in params and not options.get("foreach"):
        fix = f"torch.optim.{name}(..., foreach=True) updates all parameters in a few batched kernels"
    else:
        fix = f"{name} has no fused or foreach variant here; an optimizer with one (AdamW, SGD) steps faster"
    count = sum(len(g["params"]) for g in opt.param_groups)
    return Finding("optimizer", share, f"{name}.step() over {count} parameter tensor(s)",
                   f"{m.phase_ms_median('optimizer'):.2f} ms of each step in optimizer.step() "
                   f"({_pct(share)})", fix + ".")
