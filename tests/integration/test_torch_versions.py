"""The shipped op lists across torch versions: version bounds, the tensor-op rule, inactive entries, error paths.

Each check is written to hold on every supported torch (2.11-2.15): versions are passed in or patched, and the
functions torch moved or removed are rebuilt here as small modules whose ``__name__`` is inside torch.
"""
import os
import sys
import types

import pytest
import torch
from tests_support import REPO

import amp_patch
from amp_patch.config import oplist, torch_bounds
from amp_patch.errors import ConfigError, OpListError
from amp_patch.patching import resolve
from amp_patch.tools import cli


def _torch_module(name, source):
    """A module named ``torch.<name>`` (so torch "defines" its functions) running ``source``."""
    module = types.ModuleType(f"torch.{name}")
    module.__dict__["torch"] = torch
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


WRAPPERS = _torch_module("_amp_patch_test_wrappers", '''
def cholesky(input, upper=False):
    return torch.linalg.cholesky(input, upper=upper)

def _max_pool1d(input, kernel_size):
    return torch.max_pool1d(input, kernel_size)

def qr(input, some=True):
    raise RuntimeError("torch.qr was removed; use torch.linalg.qr")

def method_qr(self):
    return qr(self)

def get_default_thing():
    return torch.tensor(0.0)
''')
WRAPPERS.method_qr.__name__ = "qr"


@pytest.mark.parametrize("name", ["cholesky", "_max_pool1d"])
def test_a_torch_python_wrapper_of_a_same_named_tensor_op_is_a_tensor_op(name):
    assert resolve.is_tensor_op(getattr(WRAPPERS, name))


def test_a_torch_function_that_only_creates_tensors_is_not_a_tensor_op():
    assert not resolve.is_tensor_op(WRAPPERS.get_default_thing)
    assert not resolve.is_tensor_op(torch.manual_seed) and not resolve.is_tensor_op(torch.save)


@pytest.mark.parametrize("name", ["qr", "method_qr"])
def test_a_removed_op_stub_is_refused_with_the_max_torch_fix(name):
    with pytest.raises(ConfigError) as info:
        resolve.resolve_name("torch._amp_patch_test_wrappers", WRAPPERS, name)
    message = str(info.value)
    assert f"only raises in torch {torch.__version__}" in message and "max_torch" in message


@pytest.mark.parametrize("version, spec, skipped", [
    ("2.13.0+cpu", {"max_torch": "2.13"}, False),
    ("2.13.1", {"max_torch": "2.13"}, False),
    ("2.14.0", {"max_torch": "2.13"}, True),
    ("2.14.1+cu130", {"max_torch": "2.13.5"}, True),
    ("2.14.0a0+git123", {"min_torch": "2.14"}, False),
    ("2.13.1", {"min_torch": "2.14"}, True),
    ("2.11.0+cu130", {"min_torch": "2.11", "max_torch": "2.15"}, False),
    ("2.16.0.dev20260101", {"max_torch": "2.15"}, True),
])
def test_version_bounds_cover_every_release_they_prefix(version, spec, skipped):
    reason = torch_bounds.version_skip(spec, version)
    assert (reason is not None) is skipped, reason
    if skipped:
        assert version in reason


@pytest.mark.parametrize("version, inactive", [
    ("2.13.0+cpu", {"torch_cpu": {"torch._C._linalg.linalg_matrix_sqrth", "torch.linalg.matrix_sqrth"}}),
    ("2.15.0", {"torch_cpu": {"torch.cholesky", "torch.qr", "torch.Tensor.cholesky", "torch.Tensor.qr"}}),
])
def test_lists_prints_the_entries_inactive_on_this_torch(monkeypatch, capsys, version, inactive):
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(oplist, "resolve_name", lambda target, owner, name: None)  # every op "exists"
    assert cli.main(["lists"]) == 0
    out = capsys.readouterr().out
    for name, qualnames in inactive.items():
        [summary] = [line for line in out.splitlines() if line.startswith(name + " ")]
        assert f"skipped on torch {version}" in summary
        for qualname in qualnames:
            assert f"  skipped float {qualname} (op_lists/{name}.yaml:" in out
    assert "needs torch" in out


def test_every_shipped_list_loads_here_and_names_its_inactive_entries():
    for name in amp_patch.shipped_names():
        table = amp_patch.load_op_lists(name)
        lines = oplist.inactive_report(table)
        assert len(lines) == len(table.skipped)
        assert all(torch.__version__ in line for line in lines)


def test_an_error_in_a_shipped_list_names_the_file_a_user_can_open(monkeypatch):
    def refuse_matmul(target, owner, name):
        if name == "matmul":
            raise ConfigError("refused for the test")
    monkeypatch.setattr(oplist, "resolve_name", refuse_matmul)
    with pytest.raises(OpListError) as info:
        amp_patch.load_op_lists("torch_cpu")
    path = info.value.path
    assert os.path.isabs(path) and os.path.isfile(path) and path == os.path.realpath(path)
    assert path.endswith("torch_cpu.yaml") and str(info.value).startswith(f"{path}:")
    with open(path, encoding="utf-8") as f:
        assert "matmul" in f.read().splitlines()[info.value.line - 1]


def test_an_extended_shipped_list_error_also_names_the_real_file(monkeypatch, tmp_path):
    monkeypatch.setattr(oplist, "resolve_name", lambda t, o, n: (_ for _ in ()).throw(ConfigError("no")))
    mine = tmp_path / "mine.yaml"
    mine.write_text("extends: apex\n", encoding="utf-8")
    with pytest.raises(OpListError) as info:
        amp_patch.load_op_lists(str(mine))
    assert os.path.isfile(info.value.path) and info.value.path.endswith("apex.yaml")


def test_lstm_under_torch_cuda_runs_in_half_as_cudnn_rnn_does():
    """Every CUDA build registers aten::_cudnn_rnn for autocast; torch_cuda reaches it through torch._VF.lstm."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(3, 4)
    x = torch.randn(2, 1, 3)
    with amp_patch.autocast(op_lists="torch_cuda", half_dtype=torch.bfloat16):
        out, (h, c) = lstm(x)
    assert out.dtype == h.dtype == torch.bfloat16
    table = amp_patch.load_op_lists("torch_cuda")
    assert all(table.category_of("torch._VF", n) == "half" for n in ("lstm", "gru", "rnn_tanh", "rnn_relu"))


def test_importing_this_file_left_no_module_behind():
    assert "torch._amp_patch_test_wrappers" not in sys.modules


def test_an_internal_torch_lacks_is_an_error_naming_the_torch_version():
    from amp_patch._torch import compat as torch_compat

    rules = torch_compat.internal("torch._dynamo.trace_rules.get_torch_obj_rule_map", "the test")
    assert callable(rules)
    with pytest.raises(amp_patch.TorchVersionError) as info:
        torch_compat.internal("torch._dynamo.trace_rules.a_name_no_torch_has", "to keep dynamo's tables right")
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert f"torch {torch.__version__}" in message and "torch._dynamo.trace_rules.a_name_no_torch_has" in message
    assert "to keep dynamo's tables right" in message and torch_compat.REQUIREMENT in message


def test_a_dynamo_without_the_trace_rules_amp_patch_reads_fails_clearly(monkeypatch):
    from torch._dynamo import trace_rules

    from amp_patch._torch import dynamo_tables

    monkeypatch.delattr(trace_rules, "get_tensor_method")
    with pytest.raises(amp_patch.TorchVersionError, match="get_tensor_method"):
        dynamo_tables.build_before_patching()


def test_the_declared_torch_range_is_the_tested_one():
    from amp_patch._torch import compat as torch_compat

    setup_cfg = os.path.join(str(REPO), "setup.cfg")
    with open(setup_cfg, encoding="utf-8") as f:
        assert f"    {torch_compat.REQUIREMENT}\n" in f.read()
    assert torch_compat.tested(), f"torch {torch.__version__} is outside the tested range {torch_compat.TESTED}"
    assert [torch_compat.tested(v) for v in ("2.10.2", "2.11.0+cu130", "2.15.1", "2.16.0a0")] == [
        False, True, True, False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
def test_cudnn_rnn_under_torch_cuda_matches_native_cuda_autocast(cls, half):
    """On a GPU nn.LSTM/GRU reach aten::_cudnn_rnn, which native CUDA autocast runs in half: so does torch_cuda."""
    torch.manual_seed(0)
    rnn = cls(8, 16, num_layers=2).cuda()
    x = torch.randn(5, 3, 8, device="cuda")
    with torch.autocast("cuda", dtype=half):
        native = rnn(x)[0]
    with amp_patch.autocast(op_lists="torch_cuda", half_dtype=half):
        ours = rnn(x)[0]
    assert native.dtype == ours.dtype == half
    assert torch.equal(native, ours)
