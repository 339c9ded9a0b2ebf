"""The tools read half-precision hardware from one place: CPU flags and CUDA capability."""
import pytest
import torch

from amp_patch.tools import machine


def _cpuinfo(tmp_path, flags):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\nflags\t\t: fpu sse2 {flags}\n")
    return str(path)


def test_cpu_flags_keep_only_the_half_precision_ones(tmp_path):
    assert machine.cpu_flags(_cpuinfo(tmp_path, "avx2 avx512f avx512_bf16 amx_tile")) == ("avx512_bf16",)


def test_missing_cpuinfo_reads_as_no_flags(tmp_path):
    assert machine.cpu_flags(str(tmp_path / "absent")) == ()


@pytest.mark.parametrize("flags, dtype, native", [
    (("avx512_bf16",), torch.bfloat16, True),
    (("amx_bf16",), torch.bfloat16, True),
    (("avx512_bf16",), torch.float16, False),
    ((), torch.bfloat16, False),
    (("amx_fp16",), torch.float16, True),
])
def test_half_hardware_on_the_cpu_follows_the_flags(flags, dtype, native):
    found = machine.half_hardware("cpu", dtype, flags=flags)
    assert found.native is native
    assert ("on hardware" in found.sentence()) is native
    assert (flags[0] in found.evidence) if native else "none of" in found.evidence


def test_a_dtype_that_is_not_half_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="torch.float16 or torch.bfloat16"):
        machine.half_hardware("cpu", torch.float32)


def test_describe_names_torch_and_threads():
    line = machine.describe("cpu")
    threads = torch.get_num_threads()
    assert torch.__version__ in line and line.endswith(f", {threads} thread{'' if threads == 1 else 's'}")


def test_describe_names_the_threads_a_run_used_with_their_plural():
    assert machine.describe("cpu", threads=1).endswith(", 1 thread")
    assert machine.describe("cpu", threads=2).endswith(", 2 threads")
