"""Malformed op lists: every one raises ``amp_patch.OpListError`` whose message starts with ``path:line:`` and
names the offending entry; nothing else ever comes out of ``load_op_lists``.

Cases are YAML texts in which the offending line ends with the marker ``# <--``; the test derives the expected
line from it (no marker: the problem concerns the whole file and the line is ``?``).
"""
import itertools
import re
import string
import textwrap

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import amp_patch
from amp_patch.config.oplist import CATEGORIES

MARK = "# <--"


class Case:
    def __init__(self, id, text, fragment, files=None, err_file="list.yaml", line=None):
        self.line = line  # explicit line where the text cannot carry a marker
        self.id, self.text, self.fragment = id, textwrap.dedent(text).lstrip("\n"), fragment
        self.files = {k: textwrap.dedent(v).lstrip("\n") for k, v in (files or {}).items()}
        self.err_file = err_file


def _marked_line(text):
    lines = [i for i, line in enumerate(text.splitlines(), 1) if line.rstrip().endswith(MARK)]
    assert len(lines) <= 1, "a case marks at most one line"
    return lines[0] if lines else None


C = Case
CASES = [
    # ------------------------------------------------------------------ top level
    C("unknown_top_key", """
        description: x
        halff:                # <--
          torch: [matmul]
        """, "'halff'"),
    C("unknown_top_key_fp16_hint", """
        fp16:                 # <--
          torch: [matmul]
        """, "did you mean 'half'"),
    C("unknown_top_key_fp32_hint", """
        schema_version: 1
        fp32: {torch: [exp]}  # <--
        """, "did you mean 'float'"),
    C("top_level_list", """
        - half                # <--
        - float
        """, "must be a mapping"),
    C("top_level_scalar", """
        just a string         # <--
        """, "must be a mapping"),
    C("empty_file", "", "must be a mapping", line=1),
    C("schema_version_2", """
        description: x
        schema_version: 2     # <--
        """, "schema_version 2"),
    C("schema_version_string", """
        schema_version: "1"   # <--
        """, "schema_version '1'"),
    C("schema_version_bool", """
        schema_version: true  # <--
        """, "schema_version True"),
    C("schema_version_float", """
        schema_version: 1.0   # <--
        """, "schema_version 1.0"),
    C("description_not_string", """
        description: [a, b]   # <--
        """, "description"),
    # ------------------------------------------------------------------ categories and shapes
    C("category_as_list", """
        half:                 # <--
          - matmul
        """, "category 'half'"),
    C("category_as_string", """
        float: exp            # <--
        """, "category 'float'"),
    C("target_maps_to_string", """
        half:
          torch: matmul       # <--
        """, "half.torch"),
    C("target_maps_to_mapping", """
        half:
          torch:              # <--
            name: matmul
        """, "half.torch"),
    C("target_maps_to_null", """
        promote:
          torch:              # <--
        """, "promote.torch"),
    C("entry_int", """
        half:
          torch:
            - matmul
            - 42              # <--
        """, "42"),
    C("entry_null", """
        half:
          torch:
            - mm
            - null            # <--
        """, "None"),
    C("entry_list", """
        float:
          torch:
            - [exp]           # <--
        """, "['exp']"),
    C("entry_bool", """
        float:
          torch: [exp,
                  true]       # <--
        """, "True"),
    C("entry_mapping_without_name", """
        half:
          torch:
            - optional: true  # <--
        """, "needs 'name:"),
    C("entry_name_not_string", """
        half:
          torch:
            - name: 3         # <--
        """, "got 3"),
    C("unknown_entry_key", """
        half:
          torch:
            - name: matmul
              optinal: true   # <--
        """, "'optinal'"),
    C("unknown_entry_key_flow", """
        half:
          torch:
            - {name: matmul, dtype: half}  # <--
        """, "'dtype'"),
    C("add_unknown_category", """
        extends: apex
        add:
          halff:              # <--
            torch: [exp]
        """, "'halff'"),
    C("add_not_mapping", """
        extends: apex
        add:                  # <--
          - half
        """, "add must map"),
    C("add_category_as_list", """
        extends: apex
        add:
          float:              # <--
            - exp
        """, "category 'float'"),
    C("remove_not_mapping", """
        extends: apex
        remove: matmul        # <--
        """, "remove must map"),
    C("remove_target_not_list", """
        extends: apex
        remove:
          torch: matmul       # <--
        """, "remove.torch"),
    C("remove_entry_mapping", """
        extends: apex
        remove:
          torch:
            - name: matmul    # <--
        """, "not a name"),
    C("remove_entry_list", """
        extends: apex
        remove:
          torch:
            - mm
            - [matmul]        # <--
        """, "['matmul']"),
    # ------------------------------------------------------------------ names that do not resolve
    C("typo_lienar", """
        half:
          torch.nn.functional:
            - conv2d
            - lienar          # <--
        """, "torch.nn.functional.lienar does not exist"),
    C("typo_torch", """
        half:
          torch: [matmul, mm, bmmm]   # <--
        """, "torch.bmmm"),
    C("typo_tensor_method", """
        promote:
          torch.Tensor:
            - matmull         # <--
        """, "torch.Tensor.matmull"),
    C("dotted_name", """
        half:
          torch:
            - nn.functional.linear  # <--
        """, "nn.functional.linear"),
    C("os_system_as_name", """
        half:
          torch:
            - "os.system"     # <--
        """, "os.system"),
    C("empty_name", """
        half:
          torch:
            - ""              # <--
        """, "''"),
    C("typo_in_add", """
        extends: apex
        add:
          float:
            torch.nn.functional:
              - gelu
              - sofmax        # <--
        """, "sofmax"),
    C("typo_in_extended_file", """
        extends: base.yaml
        """, "lienar", files={"base.yaml": """
        half:
          torch.nn.functional:
            - linear
            - lienar          # <--
        """}, err_file="base.yaml"),
    # ------------------------------------------------------------------ duplicates
    C("duplicate_in_category", """
        half:
          torch:
            - matmul
            - mm
            - matmul          # <--
        """, "torch.matmul is listed twice"),
    C("duplicate_across_categories", """
        half:
          torch: [matmul]
        float:
          torch: [exp, matmul]  # <--
        """, "torch.matmul is listed twice"),
    C("duplicate_across_categories_in_add", """
        extends: apex
        add:
          half:
            torch: [exp]
          float:
            torch:
              - exp           # <--
        """, "torch.exp is listed twice"),
    C("duplicate_target_key", """
        half:
          torch: [matmul]
          torch: [mm]         # <--
        """, "duplicate key 'torch'"),
    C("duplicate_top_key", """
        half:
          torch: [matmul]
        float:
          torch: [exp]
        half:                 # <--
          torch: [mm]
        """, "duplicate key 'half'"),
    C("duplicate_entry_key", """
        banned:
          torch.nn.functional:
            - name: binary_cross_entropy
              message: a
              message: b      # <--
        """, "duplicate key 'message'"),
    C("add_already_in_same_category", """
        extends: apex
        add:
          half:
            torch.nn.functional:
              - linear        # <--
        """, "torch.nn.functional.linear is already half"),
    # ------------------------------------------------------------------ targets outside torch
    C("target_os", """
        half:
          os: [system]        # <--
        """, "'os'"),
    C("target_builtins", """
        banned:
          builtins: [eval]    # <--
        """, "'builtins'"),
    C("target_subprocess", """
        float:
          subprocess:         # <--
            - run
        """, "'subprocess'"),
    C("target_torch_os", """
        half:
          torch.os: [system]  # <--
        """, "'torch.os'"),
    C("target_torch_sys", """
        half:
          torch: [matmul]
          torch.sys: [exit]   # <--
        """, "'torch.sys'"),
    C("name_torch_os", """
        half:
          torch:
            - os              # <--
        """, "torch.os is a module"),
    C("target_not_dotted_name", """
        half:
          "torch..nn": [linear]   # <--
        """, "'torch..nn'"),
    C("target_with_space", """
        half:
          "torch nn": [linear]    # <--
        """, "'torch nn'"),
    C("target_missing_submodule", """
        half:
          torch.no_such_module: [f]   # <--
        """, "'torch.no_such_module'"),
    C("target_is_function", """
        half:
          torch.matmul: [x]   # <--
        """, "'torch.matmul'"),
    C("target_torch_classes_namespace", """
        half:
          torch.classes.foo: [bar]    # <--
        """, "torch.classes.foo.bar"),
    C("remove_outside_torch", """
        extends: apex
        remove:
          os:
            - system          # <--
        """, "os.system"),
    # ------------------------------------------------------------------ dunders, classes, modules, non-torch callables
    C("dunder_init", """
        half:
          torch.Tensor: [__init__]  # <--
        """, "torch.Tensor.__init__ is not an operator dunder"),
    C("dunder_getattribute", """
        half:
          torch.Tensor:
            - __matmul__
            - __getattribute__  # <--
        """, "__getattribute__"),
    C("dunder_torch_function", """
        promote:
          torch.Tensor:
            - __torch_function__  # <--
        """, "__torch_function__"),
    C("dunder_new", """
        float:
          torch.Tensor: [__new__]  # <--
        """, "__new__"),
    C("dunder_setattr", """
        float:
          torch.Tensor: [__setattr__]  # <--
        """, "__setattr__"),
    C("dunder_on_torch", """
        half:
          torch: [__import__]  # <--
        """, "torch.__import__"),
    C("class_tensor", """
        half:
          torch: [Tensor]     # <--
        """, "torch.Tensor is a"),
    C("module_nn", """
        half:
          torch: [nn]         # <--
        """, "torch.nn is a module"),
    C("dtype_not_callable", """
        half:
          torch: [float32]    # <--
        """, "torch.float32"),
    C("getset_descriptor", """
        half:
          torch.Tensor: [T]   # <--
        """, "torch.Tensor.T"),
    C("typing_optional_in_functional", """
        half:
          torch.nn.functional: [Optional]   # <--
        """, "torch.nn.functional.Optional"),
    C("typing_overload_in_torch", """
        float:
          torch: [_overload]  # <--
        """, "torch._overload"),
    # ------------------------------------------------------------------ YAML tags, anchors, keys
    C("tag_python_object_apply", """
        half:
          torch:
            - !!python/object/apply:os.system ["echo pwned"]  # <--
        """, "python/object/apply:os.system"),
    C("tag_python_name", """
        half:
          torch:
            - !!python/name:os.system ''  # <--
        """, "python/name:os.system"),
    C("tag_python_object_new", """
        half: !!python/object/new:os.system [x]  # <--
        """, "python/object/new"),
    C("tag_custom", """
        half:
          torch: [!foo matmul]  # <--
        """, "'!foo'"),
    C("tag_str", """
        half:
          torch:
            - !!str matmul    # <--
        """, "tag:yaml.org,2002:str"),
    C("tag_map", """
        description: x
        half: !!map {torch: [matmul]}  # <--
        """, "tag:yaml.org,2002:map"),
    C("tag_binary", """
        half:
          torch: [!!binary aGk=]  # <--
        """, "binary"),
    C("anchor", """
        half:
          torch: &ops [matmul]  # <--
        """, "anchors and aliases"),
    C("anchor_and_alias", """
        half:
          torch: &ops         # <--
            - matmul
        float:
          torch.Tensor: *ops
        """, "anchors and aliases"),
    C("merge_key", """
        half:
          <<: {torch: [matmul]}  # <--
        """, "merge"),
    C("int_key", """
        half:
          torch: [matmul]
        1: x                  # <--
        """, "keys must be plain strings"),
    C("null_key", """
        half:
          ~: [matmul]         # <--
        """, "NoneType None"),
    C("bool_key_in_entry", """
        half:
          torch:
            - name: matmul
              true: 1         # <--
        """, "bool True"),
    C("complex_key", """
        half:
          ? [torch, torch.Tensor]   # <--
          : [matmul]
        """, "keys must be plain strings"),
    # ------------------------------------------------------------------ entry values
    C("optional_string", """
        half:
          torch:
            - name: matmul
              optional: true
            - name: mm        # <--
              optional: 1
        """, "mm: optional must be true or false"),
    C("min_torch_garbage", """
        half:
          torch:
            - name: matmul    # <--
              min_torch: banana
        """, "min_torch 'banana'"),
    C("min_torch_float", """
        half:
          torch:
            - name: _addmm_activation   # <--
              min_torch: 2.10
        """, "_addmm_activation: min_torch"),
    C("min_torch_list", """
        half:
          torch:
            - {name: matmul, min_torch: [2, 1]}  # <--
        """, "min_torch [2, 1]"),
    C("max_torch_null", """
        float:
          torch:
            - {name: exp, max_torch: null}  # <--
        """, "max_torch None"),
    C("message_on_half", """
        half:
          torch:
            - name: matmul    # <--
              message: do not
        """, "matmul: 'message'"),
    C("message_not_string", """
        banned:
          torch.nn.functional:
            - name: binary_cross_entropy  # <--
              message: [a]
        """, "binary_cross_entropy: 'message'"),
    C("optional_does_not_excuse_bad_target", """
        half:
          os:                 # <--
            - {name: system, optional: true}
        """, "'os'"),
    # ------------------------------------------------------------------ extends
    C("extends_with_categories", """
        extends: apex         # <--
        half:
          torch: [matmul]
        """, "'extends' cannot be combined"),
    C("extends_after_categories", """
        float:
          torch: [exp]
        extends: apex         # <--
        """, "'extends' cannot be combined"),
    C("extends_missing_shipped", """
        description: mine
        extends: apexx        # <--
        """, "'apexx'"),
    C("extends_missing_file", """
        extends: missing.yaml  # <--
        """, "missing.yaml"),
    C("extends_missing_file_in_dir", """
        extends: sub/dir/base.yml  # <--
        """, "sub/dir/base.yml"),
    C("extends_directory", """
        extends: ./           # <--
        """, "'./'"),
    C("extends_null_byte", """
        extends: "a\\0.yaml"  # <--
        """, "extends"),
    C("extends_int", """
        extends: 3            # <--
        """, "extends must be"),
    C("extends_empty", """
        extends: ""           # <--
        """, "extends must be"),
    C("extends_list", """
        extends: [apex]       # <--
        """, "extends must be"),
    C("extends_self", """
        extends: list.yaml    # <--
        """, "extends itself"),
    C("extends_cycle", """
        extends: a.yaml
        """, "extends itself", files={
            "a.yaml": "extends: b.yaml\n",
            "b.yaml": "description: b\nextends: a.yaml  # <--\n"}, err_file="b.yaml"),
    C("remove_missing_from_base", """
        extends: apex
        remove:
          torch.nn.functional:
            - gelu
        """ + "    - lienar   " + MARK + "\n", "torch.nn.functional.lienar"),
    C("remove_wrong_target", """
        extends: apex
        remove:
          torch.linalg:
            - matmul          # <--
        """, "torch.linalg.matmul"),
    C("remove_twice", """
        extends: apex
        remove:
          torch:
            - matmul
            - matmul          # <--
        """, "torch.matmul"),
    C("error_in_extended_file_reports_that_file", """
        extends: base.yaml
        """, "'bogus'", files={"base.yaml": "half: {torch: [mm]}\nbogus: 1  # <--\n"}, err_file="base.yaml"),
    # ------------------------------------------------------------------ documents and syntax
    C("two_documents", """
        half:
          torch: [matmul]
        ---                   # <--
        float:
          torch: [exp]
        """, "expected a single document"),
    C("unclosed_flow_sequence", """
        half:
          torch: [matmul, mm
        float:                # <--
          torch: [exp]
        """, "invalid YAML"),
    C("bad_indentation", """
        half:
          torch:
            - matmul
           - mm               # <--
        """, "invalid YAML"),
    C("tab_indentation", "half:\n\ttorch: [matmul]  " + MARK + "\n", "invalid YAML"),
    C("unclosed_quote", """
        half:
          torch:
            - "matmul         # <--
        """, "invalid YAML"),
    C("mapping_value_not_allowed", """
        half:
          torch: a: b         # <--
        """, "invalid YAML"),
    C("control_character", "description: x\nhalf:\n  torch: [mat\x07mul]  " + MARK + "\n", "invalid YAML"),
    C("deep_nesting", "description: " + "[" * 3000 + "]" * 3000 + "  # <--\n", "nest"),
    C("nested_deeper_than_the_limit", "description: " + "[" * 40 + "]" * 40 + "  # <--\n", "flatten it"),
    C("too_large_is_whole_file", "description: " + "x" * (4 * 1024 * 1024) + "\n", "split it with 'extends'"),
]


def _write(tmp_path, case):
    for name, text in case.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    path = tmp_path / "list.yaml"
    path.write_text(case.text, encoding="utf-8")
    return path


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_op_list(tmp_path, case, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative extends must not depend on the working directory; see extends tests
    path = _write(tmp_path, case)
    err_text = case.text if case.err_file == "list.yaml" else case.files[case.err_file]
    line = case.line or _marked_line(err_text)
    with pytest.raises(amp_patch.OpListError) as info:
        amp_patch.load_op_lists(str(path))
    exc = info.value
    assert isinstance(exc, ValueError)
    msg = str(exc)
    prefix = f"{tmp_path / case.err_file}:{line if line is not None else '?'}: "
    assert msg.startswith(prefix), f"expected prefix {prefix!r}, got {msg!r}"
    assert exc.line == line
    assert case.fragment in msg, f"{case.fragment!r} not in {msg!r}"


def test_case_count():
    assert len(CASES) >= 50
    assert len({c.id for c in CASES}) == len(CASES)


def test_only_whole_file_cases_lack_a_line():
    unmarked = [c.id for c in CASES if not c.line and _marked_line(c.files.get(c.err_file, c.text)) is None]
    assert unmarked == ["too_large_is_whole_file"]


# -------------------------------------------------------------------------- valid lists that must load

def _load_text(tmp_path, text, name="list.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return amp_patch.load_op_lists(str(path))


def test_optional_absent_entry_is_skipped_and_reported(tmp_path):
    table = _load_text(tmp_path, """
        half:
          torch:
            - matmul
            - name: op_that_torch_does_not_have
              optional: true
        """)
    assert table.category_of("torch", "matmul") == "half"
    assert ("torch", "op_that_torch_does_not_have") not in table
    [skipped] = table.skipped
    assert skipped.entry.name == "op_that_torch_does_not_have" and skipped.entry.line == 4
    assert "optional" in skipped.reason


def test_optional_present_entry_is_kept(tmp_path):
    table = _load_text(tmp_path, "half:\n  torch:\n    - {name: mm, optional: true}\n")
    assert table.category_of("torch", "mm") == "half" and not table.skipped


def test_min_torch_in_the_future_is_skipped(tmp_path):
    table = _load_text(tmp_path, """
        float:
          torch:
            - exp
            - name: op_from_the_future
              min_torch: "99.0"
          torch.nn.functional:
            - {name: gelu, max_torch: "1.0"}
        """)
    assert len(table) == 1
    reasons = {s.entry.name: s.reason for s in table.skipped}
    assert set(reasons) == {"op_from_the_future", "gelu"}
    assert "99.0" in reasons["op_from_the_future"] and "1.0" in reasons["gelu"]


def test_min_torch_int_and_past_version_load(tmp_path):
    table = _load_text(tmp_path, 'half:\n  torch:\n    - {name: mm, min_torch: 2}\n'
                                 '    - {name: bmm, min_torch: "2.1"}\n')
    assert table.category_of("torch", "mm") == "half" and table.category_of("torch", "bmm") == "half"


def test_min_torch_satisfied_but_missing_is_an_error(tmp_path):
    with pytest.raises(amp_patch.OpListError, match=r"list\.yaml:3: .*not_an_op"):
        _load_text(tmp_path, 'half:\n  torch:\n    - name: not_an_op\n      min_torch: "2.0"\n')


def test_add_moves_an_entry_between_categories(tmp_path):
    base = amp_patch.load_op_lists("apex")
    assert base.category_of("torch.nn.functional", "linear") == "half"
    table = _load_text(tmp_path, """
        extends: apex
        add:
          float:
            torch.nn.functional: [linear]
        """)
    assert table.category_of("torch.nn.functional", "linear") == "float"
    assert len(table) == len(base)
    assert table.get("torch.nn.functional", "linear").line == 4


def test_documented_example_moves_gelu(tmp_path):
    table = _load_text(tmp_path, """
        extends: apex
        remove:
          torch.nn.functional: [gelu]
        add:
          half:
            torch.nn.functional: [gelu]
        """)
    assert table.category_of("torch.nn.functional", "gelu") == "half"


def test_sequence_is_applied_in_order():
    table = amp_patch.load_op_lists(["apex", {"remove": {"torch.nn.functional": ["gelu"]}},
                                     {"add": {"half": {"torch": ["exp"]}}}])
    assert ("torch.nn.functional", "gelu") not in table
    assert table.category_of("torch", "exp") == "half"
    assert table.category_of("torch.nn.functional", "linear") == "half"


def test_sequence_full_list_replaces_what_came_before():
    table = amp_patch.load_op_lists(["apex", {"half": {"torch": ["mm"]}}])
    assert len(table) == 1 and table.category_of("torch", "mm") == "half"


def test_sequence_layer_errors_name_the_layer(tmp_path):
    path = tmp_path / "layer.yaml"
    path.write_text("remove:\n  torch:\n    - matmul\n    - not_in_apex\n", encoding="utf-8")
    with pytest.raises(amp_patch.OpListError, match=rf"^{re.escape(str(path))}:4: .*not_in_apex"):
        amp_patch.load_op_lists(["apex", str(path)])


def test_mapping_spec_loads():
    table = amp_patch.load_op_lists({"half": {"torch": ["matmul"]}, "banned": {
        "torch.nn.functional": [{"name": "binary_cross_entropy", "message": "no"}]}})
    assert table.category_of("torch", "matmul") == "half"
    assert table.get("torch.nn.functional", "binary_cross_entropy").message == "no"


def test_mapping_spec_with_extends_loads():
    table = amp_patch.load_op_lists({"extends": "apex", "remove": {"torch": ["matmul"]}})
    assert ("torch", "matmul") not in table and len(table) == len(amp_patch.load_op_lists("apex")) - 1


@pytest.mark.parametrize("spec, fragment", [
    ({"half": {"torch": ["lienar"]}}, "torch.lienar"),
    ({"bogus": 1}, "'bogus'"),
    ({"half": {"os": ["system"]}}, "'os'"),
    ({"extends": "apex", "half": {"torch": ["mm"]}}, "'extends' cannot be combined"),
    ({"extends": "apex", "remove": {"torch": [{"name": "mm"}]}}, "not a name"),
])
def test_mapping_spec_errors_report_mapping(spec, fragment):
    with pytest.raises(amp_patch.OpListError) as info:
        amp_patch.load_op_lists(spec)
    assert str(info.value).startswith("<mapping>:?: ") and fragment in str(info.value)


def test_relative_extends_is_relative_to_the_file(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "base.yaml").write_text("half:\n  torch: [mm]\n", encoding="utf-8")
    (tmp_path / "sub" / "top.yaml").write_text("extends: base.yaml\nadd:\n  float:\n    torch: [exp]\n",
                                               encoding="utf-8")
    monkeypatch.chdir("/")
    table = amp_patch.load_op_lists(str(tmp_path / "sub" / "top.yaml"))
    assert table.category_of("torch", "mm") == "half" and table.category_of("torch", "exp") == "float"


def test_null_category_and_comments_load(tmp_path):
    table = _load_text(tmp_path, """
        # comment
        description: "only promote"
        schema_version: 1
        half:
        promote:
          torch: [add]   # trailing comment
          torch.Tensor: [__add__, __radd__, __iadd__]
        """)
    assert len(table) == 4 and table.counts()["promote"] == 4


def test_shipped_lists_load():
    for name in amp_patch.shipped_names():
        assert len(amp_patch.load_op_lists(name)) > 0


# -------------------------------------------------------------------------- hypothesis

HSETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                       HealthCheck.too_slow], derandomize=True)
_counter = itertools.count()

IDENT = st.text(alphabet=string.ascii_letters + string.digits + "_", min_size=1, max_size=12).filter(
    lambda s: not s[0].isdigit())
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False, width=32),
                    st.text(max_size=8), IDENT,
                    st.sampled_from(["matmul", "lienar", "__init__", "os", "Tensor", "apex", "torch_cpu", "a.yaml",
                                     "2.1", "99.0", "banana", "torch", "torch.os", "system"]))
KEYS = st.one_of(st.sampled_from(("description", "schema_version", "extends", "add", "remove", "name", "optional",
                                  "min_torch", "max_torch", "message", "note", "torch", "torch.Tensor", "os",
                                  "torch.nn.functional", "builtins") + CATEGORIES), IDENT)
TREES = st.recursive(SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                     st.dictionaries(KEYS, kids, max_size=4)), max_leaves=12)
TARGETS = st.one_of(st.sampled_from(["torch", "torch.nn.functional", "torch.Tensor", "torch.linalg", "os",
                                     "builtins", "torch.os", "subprocess", "torch.sys", "torch.matmul"]),
                    IDENT, IDENT.map(lambda s: "torch." + s))
NOT_IN_TORCH = IDENT.filter(lambda s: not s.startswith("__")).map(lambda s: "zz_" + s)


def _scalar(s):
    """``s`` as a YAML string scalar: plain where YAML reads it back as that string (not ``TRUE``, ``null`` ...)."""
    return s if yaml.safe_load(s) == s else f'"{s}"'


def _path(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / f"hyp_{next(_counter)}.yaml"


def _load_only_oplist_error(path, text):
    path.write_text(text, encoding="utf-8")
    try:
        return amp_patch.load_op_lists(str(path)), None
    except amp_patch.OpListError as exc:
        assert isinstance(exc, ValueError)
        return None, exc


@settings(max_examples=70, **HSETTINGS)
@given(doc=st.one_of(TREES, st.dictionaries(KEYS, TREES, max_size=5)))
def test_random_documents_raise_only_oplist_errors_with_a_line(tmp_path_factory, doc):
    path = _path(tmp_path_factory)
    _, exc = _load_only_oplist_error(path, yaml.safe_dump(doc))
    if exc is not None:
        # safe_dump writes plain, well-formed YAML: every problem in it has a line
        assert re.match(rf"^{re.escape(str(path))}:\d+: ", str(exc)), str(exc)


@settings(max_examples=50, **HSETTINGS)
@given(text=st.lists(st.sampled_from(list("abt:-[]{},&*!|>'\"#%@?` \n\n\n  \t\x00\x07\\") + [
    "torch", "half", "float", "matmul", "!!python/name:os.system", "!foo", "extends", "apex", "---", "...", "<<",
    "name", "optional", "torch.Tensor", "__init__", "os", "lienar", "- ", ": ", "\n  ", "\n    - "]),
    max_size=40).map("".join))
def test_random_text_raises_only_oplist_errors(tmp_path_factory, text):
    path = _path(tmp_path_factory)
    _, exc = _load_only_oplist_error(path, text)
    if exc is not None:
        assert re.match(rf"^{re.escape(str(path))}:(\d+|\?): ", str(exc)), str(exc)


@settings(max_examples=40, **HSETTINGS)
@given(category=st.sampled_from(CATEGORIES), target=st.sampled_from(["torch", "torch.nn.functional", "torch.Tensor"]),
       name=NOT_IN_TORCH, pad=st.integers(0, 3))
def test_near_miss_name_is_reported_at_its_line(tmp_path_factory, category, target, name, pad):
    text = "description: near miss\n" + "\n" * pad + f"{category}:\n  {target}:\n    - {name}\n"
    path = _path(tmp_path_factory)
    _, exc = _load_only_oplist_error(path, text)
    assert exc is not None
    assert str(exc).startswith(f"{path}:{pad + 4}: ") and f"{target}.{name}" in str(exc)


@settings(max_examples=40, **HSETTINGS)
@given(category=st.sampled_from(CATEGORIES), target=TARGETS, name=st.one_of(IDENT, st.just("matmul")),
       in_add=st.booleans())
def test_random_target_is_reported_at_its_line(tmp_path_factory, category, target, name, in_add):
    head = f"extends: apex\nadd:\n  {category}:\n" if in_add else f"{category}:\n"
    indent = "    " if in_add else "  "
    text = head + f"{indent}{_scalar(target)}:\n{indent}  - {_scalar(name)}\n"
    path = _path(tmp_path_factory)
    table, exc = _load_only_oplist_error(path, text)
    if exc is None:  # a real torch target and name: it loaded into the right category
        assert table.category_of(target, name) == category
        return
    target_line, name_line = text.count("\n") - 1, text.count("\n")
    m = re.match(rf"^{re.escape(str(path))}:(\d+): ", str(exc))
    assert m, str(exc)
    assert int(m.group(1)) in (target_line, name_line)
    assert target in str(exc) or name in str(exc)
    if int(m.group(1)) == target_line:
        assert repr(target) in str(exc) or target in str(exc)
