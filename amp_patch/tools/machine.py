"""What this machine can run in half precision: the one place the tools read CPU flags and GPU capabilities.

The experiment's machine line, the speed report's ``hardware`` finding and the benchmarks all ask here, so they
cannot disagree about whether float16/bfloat16 run on hardware. The answer is a reading (``/proc/cpuinfo`` flags,
CUDA compute capability), not a measurement: a CPU without the flags still runs half precision, in software, and
then slower than fp32.
"""
from __future__ import annotations

import dataclasses
import os
import platform

import torch

#: CPU flags (as /proc/cpuinfo spells them) that mean a dtype's matmuls run on hardware; x86 first, then Arm.
CPU_FLAGS = {
    "bfloat16": ("amx_bf16", "avx512_bf16", "bf16"),
    "float16": ("amx_fp16", "avx512_fp16", "fphp"),
}
#: The CUDA compute capability from which a dtype runs on tensor cores.
CUDA_CAPABILITY = {"float16": (7, 0), "bfloat16": (8, 0)}


@dataclasses.dataclass(frozen=True)
class HalfHardware:
    """Whether ``dtype`` runs on hardware on ``device``, and the reading that says so."""

    device: str
    dtype: str
    native: bool
    evidence: str

    def sentence(self):
        slower = "fp32 and than hardware bf16" if self.dtype == "float8" else "fp32"
        where = "on hardware" if self.native else f"in software only (slower than {slower})"
        return f"{self.dtype} runs {where} on this {self.device} ({self.evidence})"


def cpu_flags(path="/proc/cpuinfo"):
    """The half-precision flags of this CPU, sorted; empty where the file is missing or lists none."""
    wanted = {flag for flags in CPU_FLAGS.values() for flag in flags}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            words = {w for line in f if line.startswith(("flags", "Features")) for w in line.split()}
    except OSError:
        return ()
    return tuple(sorted(wanted & words))


def _dtype_name(dtype):
    name = str(dtype).removeprefix("torch.")
    if name not in CPU_FLAGS:
        raise ValueError(f"dtype={dtype!r}: expected torch.float16 or torch.bfloat16")
    return name


def half_hardware(device, dtype, flags=None):
    """Read whether ``dtype`` (torch.float16/bfloat16) runs on hardware on ``device`` ("cpu", "cuda", a device)."""
    kind, name = torch.device(device).type, _dtype_name(dtype)
    if kind == "cuda":
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        need = CUDA_CAPABILITY[name]
        return HalfHardware("GPU", name, (major, minor) >= need,
                            f"compute capability {major}.{minor}; tensor cores from {need[0]}.{need[1]}")
    found = cpu_flags() if flags is None else tuple(flags)
    hits = [flag for flag in CPU_FLAGS[name] if flag in found]
    evidence = f"CPU flags: {', '.join(hits)}" if hits else f"none of {', '.join(CPU_FLAGS[name])} in the CPU flags"
    return HalfHardware("CPU", name, bool(hits), evidence)


#: The CUDA compute capability from which torch._scaled_mm runs float8 matmuls on tensor cores (Ada, Hopper).
FP8_CUDA_CAPABILITY = (8, 9)


def fp8_hardware(device):
    """Read whether the ``fp8`` op-list category's scaled matmuls run on hardware on ``device``: CUDA from compute
    capability 8.9; a CPU runs torch._scaled_mm as a reference kernel (numerics only, slower than bf16)."""
    if torch.device(device).type == "cuda":
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        need = FP8_CUDA_CAPABILITY
        return HalfHardware("GPU", "float8", (major, minor) >= need,
                            f"compute capability {major}.{minor}; float8 tensor cores from {need[0]}.{need[1]}")
    return HalfHardware("CPU", "float8", False, "torch._scaled_mm's CPU kernel is a reference: numerics only")


def describe(device="cpu", threads=None):
    """One line naming the machine: processor, CPU count, torch version and ``threads`` (the count a run used;
    None: this process's ``torch.get_num_threads()`` now)."""
    if torch.device(device).type == "cuda":
        processor = torch.cuda.get_device_name(torch.device(device))
    else:
        processor = platform.processor() or platform.machine()
    threads = torch.get_num_threads() if threads is None else threads
    return (f"{processor}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{threads} thread{'' if threads == 1 else 's'}")
