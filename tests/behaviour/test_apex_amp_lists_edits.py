"""``apex.amp.lists`` are Apex's mutable op lists; edits made before ``initialize`` reach the op
table, misspelt names fail with ``file:line`` of the edit and the list's name."""
import importlib.util
import textwrap

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from amp_patch import legacy
from amp_patch.legacy import amp_lists
from amp_patch.legacy.amp_lists._names import OpNameList


@pytest.fixture(autouse=True)
def pristine_lists():
    """The lists are process-wide (as Apex's were): put every one back as Apex shipped it after each test."""
    modules = (amp_lists.functional_overrides, amp_lists.torch_overrides, amp_lists.tensor_overrides)
    saved = {(m, k): v for m in modules for k, v in vars(m).items() if isinstance(v, OpNameList)}
    yield
    for (module, kind), names in saved.items():
        setattr(module, kind, names)
        list.clear(names)
        list.extend(names, names.pristine)
        names.where.clear()
    amp_patch.deinitialize()


def _import(tmp_path, source, name="tacotron_like"):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path


def test_a_module_editing_amp_lists_at_import_changes_the_o1_op_table(tmp_path):
    x = torch.randn(2, 3)
    with legacy.install_apex_alias():
        _import(tmp_path, """\
            from apex import amp
            import apex.amp.lists.torch_overrides as torch_lists
            amp.lists.functional_overrides.FP32_FUNCS.remove("softmax")
            amp.lists.functional_overrides.FP16_FUNCS.append("softmax")
            torch_lists.FP32_FUNCS.remove("exp")
            """)
        from apex import amp
        assert amp.lists.functional_overrides.MODULE is F and "softmax" in amp.lists.functional_overrides.FP16_FUNCS
        amp.initialize(torch.nn.Linear(3, 3), opt_level="O1", verbosity=0)
        assert F.softmax(x, dim=1).dtype is torch.float16  # moved from float to half, as the script asked
        assert torch.exp(x.half()).dtype is torch.float16  # no longer forced to float
        assert F.log_softmax(x.half(), dim=1).dtype is torch.float32  # others unchanged
        amp.deinitialize()
        amp.initialize(torch.nn.Linear(3, 3), opt_level="O1", verbosity=0, op_lists="apex")  # over op_lists too
        assert F.softmax(x, dim=1).dtype is torch.float16
        amp.deinitialize()
    amp_patch.initialize(torch.nn.Linear(3, 3), opt_level="O1", verbosity=0)  # the core API ignores amp.lists
    assert F.softmax(x, dim=1).dtype is torch.float32


def test_without_edits_the_op_table_is_the_shipped_one():
    assert amp_lists.overlay() is None and amp_lists.overlay("torch_cuda") == "torch_cuda"
    assert "bmm" in amp_lists.torch_overrides.FP16_FUNCS and "sum" in amp_lists.tensor_overrides.FP32_FUNCS


def test_a_misspelt_name_fails_at_initialize_with_the_file_line_of_the_edit(tmp_path):
    with legacy.install_apex_alias():
        path = _import(tmp_path, """\
            from apex import amp

            amp.lists.functional_overrides.FP16_FUNCS.append("sofmax")
            """)
        from apex import amp
        with pytest.raises(amp_patch.OpListError) as info:
            amp.initialize(torch.nn.Linear(3, 3), opt_level="O1", verbosity=0)
    message = str(info.value)
    assert message.startswith(f"{path}:3: apex.amp.lists.functional_overrides.FP16_FUNCS holds 'sofmax'")
    assert isinstance(info.value, ValueError) and amp_patch.session.state.current() is None


def test_amp_init_reads_the_lists_too_and_a_replaced_list_is_compared_with_apexs():
    amp_lists.tensor_overrides.FP32_FUNCS = [n for n in amp_lists.tensor_overrides.FP32_FUNCS if n != "sum"]
    handle = legacy.amp.init()
    assert torch.ones(2, dtype=torch.float16).sum().dtype is torch.float16  # Tensor.sum no longer forced to float
    assert torch.sum(torch.ones(2, dtype=torch.float16)).dtype is torch.float32  # torch.sum still is
    handle._deactivate()


def test_the_lists_hold_what_the_shipped_apex_op_list_holds():
    """Every name of Apex's Python lists is in the shipped ``apex`` op list with the same category (where this
    torch has it), so an edit changes exactly the entry it names."""
    table = amp_patch.load_op_lists("apex")
    skipped = {(s.entry.target, s.entry.name) for s in table.skipped}
    mismatched = []
    for target, category, names in amp_lists._lists():
        for item in names.pristine:
            name = item[0] if isinstance(item, tuple) else item
            if (target, name) in skipped:
                continue
            if table.category_of(target, name) != category:
                mismatched.append((target, name, category, table.category_of(target, name)))
    assert mismatched == []
