"""``amp-patch validate`` / ``amp-patch lists`` and the subcommand hooks of ``amp_patch.tools.cli``."""
import os
import re
import subprocess
import sys
import textwrap
import types

import pytest

import amp_patch
from amp_patch.tools import cli

VALID = """\
description: two ops
half:
  torch: [matmul]
float:
  torch:
    - exp
    - name: op_from_the_future
      min_torch: "99.0"
    - name: op_nobody_has
      optional: true
"""

INVALID = """\
half:
  torch.nn.functional:
    - linear
    - lienar
"""


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_validate_valid_file(tmp_path, capsys):
    path = _write(tmp_path, "mine.yaml", VALID)
    assert cli.main(["validate", path]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == (f"{path}: OK, 2 entries (half 1, float 1, promote 0, sequence_promote 0, banned 0); "
                        f"2 skipped on torch {amp_patch.config.oplist.torch.__version__}")
    assert lines[1].startswith(f"  skipped float torch.op_from_the_future ({path}:7): needs torch >= 99.0")
    assert lines[2].startswith(f"  skipped float torch.op_nobody_has ({path}:9): optional and absent")
    assert len(lines) == 3


def test_validate_shipped_name(capsys):
    assert cli.main(["validate", "apex"]) == 0
    out, err = capsys.readouterr()
    counts = amp_patch.load_op_lists("apex").counts()
    assert out.startswith(f"apex: OK, {sum(counts.values())} entries (half {counts['half']}, float {counts['float']},")
    assert err == ""


def test_validate_invalid_file(tmp_path, capsys):
    path = _write(tmp_path, "bad.yaml", INVALID)
    assert cli.main(["validate", path]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    first = err.splitlines()[0]
    assert first.startswith(f"{path}:4: ") and "torch.nn.functional.lienar" in first
    assert "1 of 1 op list(s) invalid" in err


def test_validate_reports_every_file(tmp_path, capsys):
    good = _write(tmp_path, "good.yaml", VALID)
    bad = _write(tmp_path, "bad.yaml", INVALID)
    worse = _write(tmp_path, "worse.yaml", "half:\n  os: [system]\n")
    assert cli.main(["validate", bad, good, worse, "torch_cpu"]) == 1
    out, err = capsys.readouterr()
    assert re.search(rf"^{re.escape(good)}: OK, 2 entries", out, re.M)
    assert re.search(r"^torch_cpu: OK, \d+ entries", out, re.M)
    assert re.search(rf"^{re.escape(bad)}:4: ", err, re.M)
    assert re.search(rf"^{re.escape(worse)}:2: .*'os'", err, re.M)
    assert "2 of 4 op list(s) invalid" in err


def test_validate_extends_error_points_at_extends_line(tmp_path, capsys):
    path = _write(tmp_path, "layer.yaml", "description: x\nextends: apexx\n")
    assert cli.main(["validate", path]) == 1
    assert capsys.readouterr().err.startswith(f"{path}:2: extends 'apexx'")


@pytest.mark.parametrize("arg", ["no_such_list", "missing.yaml", "dir/missing.yml"])
def test_validate_missing_file_or_name(tmp_path, monkeypatch, capsys, arg):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["validate", arg]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"{arg}: ") and arg in err.splitlines()[0][len(arg) + 2:]


def test_validate_bare_file_name_in_cwd(tmp_path, monkeypatch, capsys):
    _write(tmp_path, "mylist", "float:\n  torch: [exp]\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["validate", "mylist"]) == 0
    assert capsys.readouterr().out.startswith("mylist: OK, 1 entries (half 0, float 1,")


def test_validate_quiet(tmp_path, capsys):
    good = _write(tmp_path, "good.yaml", VALID)
    bad = _write(tmp_path, "bad.yaml", INVALID)
    assert cli.main(["validate", "-q", good]) == 0
    assert capsys.readouterr() == ("", "")
    assert cli.main(["validate", "--quiet", good, bad]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"{bad}:4: ")


def test_validate_needs_a_file(capsys):
    assert cli.main(["validate"]) == 2
    assert "FILE_OR_NAME" in capsys.readouterr().err


def test_lists(capsys):
    assert cli.main(["lists"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = [line for line in out.splitlines() if not line.startswith("  ")]  # indented: entries skipped here
    assert [line.split()[0] for line in lines] == amp_patch.shipped_names()
    for line in lines:
        name, count = line.split()[:2]
        table = amp_patch.load_op_lists(name)
        assert int(count) == len(table)
        assert all(f"  skipped {item.entry.category} {item.entry.qualname} " in out for item in table.skipped)
        assert f"banned {table.counts()['banned']})" in line


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "validate" in err and "lists" in err


def test_unknown_command_and_help(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "validate" in capsys.readouterr().out
    assert cli.main(["--version"]) == 0
    assert amp_patch.__version__ in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ structure

def test_registry_and_hooks_are_declared():
    assert {"validate", "lists"} <= set(cli.SUBCOMMANDS)
    assert cli.HOOKS["experiment"] == "amp_patch.tools.experiment"
    assert cli.HOOKS["run"] == "amp_patch.legacy"
    assert cli.HOOKS["trace"] == "amp_patch.tools.trace_cli"


def test_every_hook_module_registers_its_subcommand():
    import argparse

    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == set(cli.SUBCOMMANDS) | set(cli.HOOKS)


def test_trace_subcommand_prints_the_table(capsys):
    assert cli.main(["trace", "--model", "mlp", "--no-modules"]) == 0
    out = capsys.readouterr().out
    # the default list is initialize's: native CPU autocast's for the CPU model
    assert "| torch.nn.functional.linear | half | op_lists/torch_cpu.yaml:" in out
    assert "torch._C._nn.cross_entropy_loss | float" in out


def test_hook_module_adds_a_subcommand(monkeypatch, capsys):
    seen = []

    def add_parser(subparsers):
        parser = subparsers.add_parser("fake", help="a fake subcommand")
        parser.add_argument("value")
        parser.set_defaults(func=lambda args: seen.append(args.value) or 7)

    monkeypatch.setitem(sys.modules, "amp_patch_fake_hook", types.SimpleNamespace(add_parser=add_parser))
    monkeypatch.setitem(cli.HOOKS, "fake", "amp_patch_fake_hook")
    assert cli.main(["fake", "x"]) == 7
    assert seen == ["x"]
    assert cli.main(["validate", "apex"]) == 0


def test_missing_hook_module_is_skipped_quietly(monkeypatch, capsys):
    monkeypatch.setitem(cli.HOOKS, "ghost", "amp_patch._no_such_subcommand_module")
    assert cli.main(["validate", "-q", "apex"]) == 0
    assert cli.main(["ghost"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "unavailable" not in err


def test_broken_hook_module_does_not_break_validate(monkeypatch, tmp_path, capsys):
    (tmp_path / "amp_patch_broken_hook.py").write_text("raise RuntimeError('boom')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.HOOKS, "broken", "amp_patch_broken_hook")
    monkeypatch.setitem(sys.modules, "amp_patch_no_add_parser", types.SimpleNamespace())
    monkeypatch.setitem(cli.HOOKS, "empty", "amp_patch_no_add_parser")
    assert cli.main(["validate", "apex"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("apex: OK")
    assert "'broken' unavailable" in err and "boom" in err
    assert "'empty' unavailable" in err and "add_parser" in err
    sys.modules.pop("amp_patch_broken_hook", None)


def _run(*args, cwd=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_import_reads_no_yaml_and_patches_nothing():
    code = textwrap.dedent("""
        import sys
        import torch
        original = torch.matmul, torch.nn.functional.linear, torch.Tensor.__add__
        from amp_patch.config import _yaml, oplist
        def refuse(*args, **kwargs):
            raise SystemExit("YAML read at import time")
        _yaml.load = oplist._read_shipped = oplist._read_path = refuse
        import amp_patch.tools.cli
        assert (torch.matmul, torch.nn.functional.linear, torch.Tensor.__add__) == original
        lazy = [m for m in ("amp_patch.tools.experiment", "amp_patch.legacy", "amp_patch.tools.trace_cli")
                if m in sys.modules]
        assert not lazy, lazy
        print("clean")
    """)
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"


def test_python_m_amp_patch_validate_apex(tmp_path):
    result = _run("-m", "amp_patch", "validate", "apex", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert re.match(r"apex: OK, \d+ entries \(half \d+, float \d+, promote \d+, sequence_promote \d+, banned \d+\)",
                    result.stdout)
