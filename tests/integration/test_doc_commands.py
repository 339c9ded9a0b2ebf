"""Every command line README.md and docs/*.md show in a ``bash`` block is parsed by the real argument parser of the
program it runs, extracted from the markdown, so a renamed option or subcommand fails here naming the doc's
file:line (test_doc_snippets.py does the same for the python and yaml blocks).

How a line is read (shell syntax first, with :mod:`shlex`):

- ``# comment`` to the end of the line is dropped; a line ending in ``\\`` continues on the next one;
- ``&&``, ``||``, ``;`` and ``|`` separate commands; each command is checked on its own;
- ``...`` stands for arguments the reader supplies (their script's own options) and is dropped;
- ``[--opt VALUE]`` marks optional arguments: the line is checked twice, with every bracketed group and with none
  (both must parse). Brackets inside a word (``".[test]"``) are not groups.

Which parser checks a command:

- ``amp-patch ARGS`` and ``python -m amp_patch ARGS``: the parser of the function setup.cfg's console script
  ``amp-patch`` names (its module's ``build_parser()``), so every subcommand and option must exist, with valid
  values. ``amp-patch run SCRIPT ARGS`` passes ARGS to the script: a user's script (``train.py``) is only a
  positional, an ``examples/*.py`` script has its ARGS checked by its own parser (below);
- ``torchrun ARGS`` and ``python -m torch.distributed.run ARGS``: torch's own launcher parser
  (``torch.distributed.run.get_args_parser``); the program it launches (``-m amp_patch ...`` or a script) is then
  checked as above;
- ``[python] examples/NAME.py ARGS``: the example's ``build_parser()`` (every example the docs run must have one);
- other tools' commands (venv, activate, pip, pytest: :data:`NOT_OURS`) are not checked; any other program fails,
  so a new kind of command in the docs has to be taught here first.

Abbreviated options (``--half`` for ``--half-dtype``) are refused: the docs spell options in full.
The commands in :data:`RUN_FOR_REAL` are cheap and need nothing the reader must supply: they are also run.
"""
import argparse
import configparser
import contextlib
import importlib
import importlib.util
import io
import re
import shlex

import pytest
from test_doc_snippets import BLOCKS, ROOT

import amp_patch

SHELL = ("bash", "sh", "shell", "console")
SEPARATORS = {"&&", "||", ";", "|"}
PLACEHOLDER = "..."
NOT_OURS = (("python3", "-m", "venv"), ("python", "-m", "venv"), (".",), ("source",), ("pip",), ("pytest",))
PYTHONS = ("python", "python3")
# Doc commands run for real (in process, in a temporary directory): cheap, and nothing in them is a placeholder.
RUN_FOR_REAL = {"amp-patch trace --model transformer"}


# ------------------------------------------------------------------------------------------------ extraction

def _shell_lines(block_line, text):
    """(doc line number, text) per logical line of a shell block; continuation lines are joined."""
    out, pending = [], None
    for k, line in enumerate(text.splitlines()):
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line)
        else:
            pending = (block_line + 1 + k, line)
        if line.rstrip().endswith("\\"):
            pending = (pending[0], pending[1].rstrip()[:-1])
            continue
        out.append(pending)
        pending = None
    return out + ([pending] if pending else [])


def _split_commands(line):
    """The commands of one shell line, as token lists (comments dropped, split at && || ; |)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in SEPARATORS:
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in commands + [current] if c]


def _commands():
    """(where, tokens) for every command of every shell block of the docs."""
    found = []
    for path, block_line, language, _, text in BLOCKS:
        if language not in SHELL:
            continue
        for lineno, line in _shell_lines(block_line, text):
            for tokens in _split_commands(line):
                found.append((f"{path.relative_to(ROOT)}:{lineno}", tokens))
    return found


COMMANDS = _commands()


def _variants(tokens, where):
    """The argv's a documented line stands for: every ``[optional]`` group included, and none; ``...`` dropped."""
    full, required, depth = [], [], 0
    for token in tokens:
        opens = token.startswith("[")
        word = token[1:] if opens else token
        closes = depth + opens > 0 and word.endswith("]")
        word = word[:-1] if closes else word
        depth += opens
        if depth > 1 or "[" in word[:1]:
            pytest.fail(f"{where}: nested [optional] groups are not understood: {shlex.join(tokens)}")
        if word and word != PLACEHOLDER:
            full.append(word)
            if not depth:
                required.append(word)
        depth -= closes
    if depth:
        pytest.fail(f"{where}: unclosed [optional] group: {shlex.join(tokens)}")
    return [full] if full == required else [full, required]


# ------------------------------------------------------------------------------------------------ parsers

def _amp_patch_parser():
    """The parser of what setup.cfg installs as ``amp-patch`` (module:function -> that module's build_parser)."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    scripts = dict(line.split("=", 1) for line in config["options.entry_points"]["console_scripts"].split("\n")
                   if "=" in line)
    target = {k.strip(): v.strip() for k, v in scripts.items()}["amp-patch"]
    module = importlib.import_module(target.split(":")[0])
    assert module.main is getattr(module, target.split(":")[1])
    return module.build_parser()


def _example_parser(script, where):
    path = ROOT / script
    if not (path.parent == ROOT / "examples" and path.is_file()):
        pytest.fail(f"{where}: {script} is not a file under examples/")
    spec = importlib.util.spec_from_file_location(f"_doc_example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # examples do their work under `if __name__ == "__main__"`
    if not callable(getattr(module, "build_parser", None)):
        pytest.fail(f"{where}: {script} has no build_parser() returning its argparse parser; give it one")
    return module.build_parser()


def _no_abbreviations(parser):
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _no_abbreviations(sub)
    return parser


def _parse(parser, argv, where, what):
    """parser.parse_args(argv), or a failure naming the doc line with argparse's own message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return _no_abbreviations(parser).parse_args(argv)
        except SystemExit as exc:
            if exc.code == 0:  # --help / --version
                return None
    message = (err.getvalue().strip().splitlines() or ["(no message)"])[-1]
    pytest.fail(f"{where}: {what} rejects `{shlex.join(argv)}`: {message}")


# ------------------------------------------------------------------------------------------------ checks

def _check(argv, where):
    """Check one command; returns the parsed namespace of the amp-patch part, if any."""
    if any(tuple(argv[:len(prefix)]) == prefix for prefix in NOT_OURS):
        return None
    if argv[0] == "amp-patch":
        return _check_amp_patch(argv[1:], where)
    if argv[0] in PYTHONS and argv[1:3] == ["-m", "amp_patch"]:
        return _check_amp_patch(argv[3:], where)
    if argv[0] == "torchrun":
        return _check_torchrun(argv[1:], where)
    if argv[0] in PYTHONS and argv[1:3] == ["-m", "torch.distributed.run"]:
        return _check_torchrun(argv[3:], where)
    script, args = (argv[1], argv[2:]) if argv[0] in PYTHONS and len(argv) > 1 else (argv[0], argv[1:])
    if script.startswith("examples/") and script.endswith(".py"):
        return _parse(_example_parser(script, where), args, where, script)
    pytest.fail(f"{where}: `{shlex.join(argv)}`: no parser known for this program; "
                "teach tests/integration/test_doc_commands.py "
                "(or list it in NOT_OURS if it is another tool's)")


def _check_amp_patch(argv, where):
    args = _parse(_amp_patch_parser(), argv, where, "amp-patch")
    if args is not None and getattr(args, "command", None) == "run" and not args.module:
        if args.target.startswith("examples/"):
            _parse(_example_parser(args.target, where), args.args, where, args.target)
    return args


def _check_torchrun(argv, where):
    from torch.distributed.run import get_args_parser
    launch = _parse(get_args_parser(), argv, where, "torchrun")
    program = [launch.training_script, *launch.training_script_args]
    if launch.module:
        if launch.training_script != "amp_patch":
            pytest.fail(f"{where}: torchrun -m {launch.training_script}: no parser known for this module")
        return _check_amp_patch(program[1:], where)
    return _check(program, where)


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{w} {' '.join(t[:3])}" for w, t in COMMANDS])
def test_documented_command_parses(command):
    where, tokens = command
    for argv in _variants(tokens, where):
        _check(argv, where)


@pytest.mark.parametrize("text", sorted(RUN_FOR_REAL))
def test_documented_command_runs(text, tmp_path, monkeypatch, capsys):
    """The cheap doc commands, run as written (in process: cli.main is what the console script calls)."""
    assert any(shlex.join(tokens) == text for _, tokens in COMMANDS), f"{text!r} is no longer in the docs"
    monkeypatch.chdir(tmp_path)
    from amp_patch.tools import cli
    status = cli.main(shlex.split(text)[1:])
    out = capsys.readouterr().out
    amp_patch.deinitialize()
    assert status == 0, out
    assert re.search(r"^\| .+ \|$", out, re.M), out  # a markdown table came out


def test_commands_are_found_and_read():
    """The extraction itself, on the docs, and the shell syntax this file promises to understand."""
    texts = {shlex.join(t) for _, t in COMMANDS}
    assert any(t.startswith("amp-patch doctor") for t in texts) and any(t.startswith("torchrun") for t in texts)
    assert any(t.startswith("python -m torch.distributed.run") for t in texts)
    assert any("examples/ddp_train.py" in t for t in texts) and "amp-patch experiment" in texts
    assert _split_commands("a --x 1 && b 'c d' | e; f  # note") == [["a", "--x", "1"], ["b", "c d"], ["e"], ["f"]]
    assert _shell_lines(10, "a \\\n  --b 1\nc\n") == [(11, "a    --b 1"), (13, "c")]
    assert _variants(["p", "--a", "1", "[--b", "2]", "[--c]", "..."], "x") == [
        ["p", "--a", "1", "--b", "2", "--c"], ["p", "--a", "1"]]
    assert _variants(["pip", "install", ".[test]"], "x") == [["pip", "install", ".[test]"]]


@pytest.mark.parametrize("argv, complaint", [
    (["amp-patch", "trace", "--modle", "mlp"], "unrecognized arguments: --modle"),
    (["amp-patch", "trace", "--half", "float16"], "unrecognized arguments: --half"),
    (["amp-patch", "trcae"], "invalid choice: 'trcae'"),
    (["amp-patch", "doctor", "--job", "a:b", "--steps", "many"], "invalid int value: 'many'"),
    (["torchrun", "--nproc-per-nod=2", "-m", "amp_patch", "run", "t.py"], "unrecognized arguments"),
    (["torchrun", "--nproc_per_node=2", "-m", "amp_patch", "runn", "t.py"], "invalid choice: 'runn'"),
    (["torchrun", "examples/ddp_train.py", "--opt-level", "O4"], "invalid choice: 'O4'"),
    (["amp-patch", "run", "examples/ddp_train.py", "--stpes", "3"], "unrecognized arguments: --stpes"),
    (["deepspeed", "train.py"], "no parser known"),
])
def test_a_wrong_command_fails_naming_the_line(argv, complaint):
    with pytest.raises(pytest.fail.Exception) as failed:
        _check(argv, "docs/x.md:7")
    assert str(failed.value).startswith("docs/x.md:7: ") and complaint in str(failed.value), failed.value
