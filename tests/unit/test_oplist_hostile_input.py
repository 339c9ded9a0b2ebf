"""Hostile or mistaken op lists: limits, non-op torch callables, imports, symlink cycles, syntax-error lines.

Limits and the depth case live in test_oplist_errors_name_the_line.py's table; this module covers what a table row
cannot.
"""
import importlib
import sys

import pytest
import torch
import yaml

import amp_patch
from amp_patch import OpListError
from amp_patch.patching.resolve import is_tensor_op


def _write(tmp_path, text, name="list.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("qualname", ["torch.save", "torch.load", "torch.manual_seed", "torch.set_default_dtype",
                                      "torch.compile", "torch.nn.functional.has_torch_function",
                                      "torch.is_grad_enabled", "torch.seed"])
def test_non_op_torch_callables_are_refused_by_name(tmp_path, qualname):
    target, name = qualname.rsplit(".", 1)
    path = _write(tmp_path, f"half:\n  {target}:\n    - {name}\n")
    with pytest.raises(OpListError) as info:
        amp_patch.load_op_lists(path)
    assert f"{qualname} " in str(info.value) and "is not a tensor op" in str(info.value)
    assert info.value.line == 3


@pytest.mark.parametrize("op", [torch.matmul, torch.nn.functional.softmax, torch.Tensor.__matmul__,
                                torch._C._nn.mse_loss, torch.Tensor._addmm_activation, torch._VF.cdist,
                                torch.nn.functional.layer_norm])
def test_tensor_ops_are_ops(op):
    assert is_tensor_op(op)


def test_every_shipped_entry_is_a_tensor_op():
    for name in amp_patch.shipped_names():
        assert len(amp_patch.load_op_lists(name)) > 100  # loading validates each entry


def test_loading_never_imports_a_module(tmp_path, monkeypatch):
    assert "torch.utils.bottleneck" not in sys.modules
    path = _write(tmp_path, "half:\n  torch.utils.bottleneck:\n    - main\n")
    imported = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda *a, **k: imported.append(a) or real(*a, **k))
    with pytest.raises(OpListError, match="import it before loading the list"):
        amp_patch.load_op_lists(path)
    for name in amp_patch.shipped_names():
        amp_patch.load_op_lists(name)
    assert [a for a in imported if a[0].startswith("torch")] == [] and "torch.utils.bottleneck" not in sys.modules


def test_an_imported_submodule_may_be_named(tmp_path):
    path = _write(tmp_path, "float:\n  torch.nn.modules.rnn._VF:\n    - lstm\n")
    assert ("torch.nn.modules.rnn._VF", "lstm") in amp_patch.load_op_lists(path)


def test_extends_cycle_through_a_symlinked_folder_is_a_cycle(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path, target_is_directory=True)
    path = _write(tmp_path, "extends: loop/list.yaml\n")
    with pytest.raises(ValueError) as info:  # OpListError (the extends line) or ConfigError
        amp_patch.load_op_lists(path)
    assert "cycle" in str(info.value) and "symbolic links" not in str(info.value)


def test_the_text_is_parsed_once(tmp_path, monkeypatch):
    monkeypatch.setattr(yaml, "parse", lambda *a, **k: pytest.fail("a second parse of the text"))
    path = _write(tmp_path, "extends: apex\nadd:\n  float:\n    torch: [lgamma]\n")
    assert amp_patch.load_op_lists(path).get("torch", "lgamma").category == "float"


def test_a_syntax_error_names_where_the_broken_construct_starts(tmp_path):
    text = "half:\n  torch: [matmul,\n    mm,\n    bmm\nfloat:\n  torch: [exp]\n"
    with pytest.raises(OpListError) as info:
        amp_patch.load_op_lists(_write(tmp_path, text))
    assert info.value.line == 5 and "starts at line 2" in str(info.value)
