"""The ``amp-patch`` command line (``python -m amp_patch`` does the same).

Subcommands built in here:

    amp-patch validate FILE_OR_NAME...   load and check op lists; exit 0 if all are valid, 1 otherwise
    amp-patch lists                      the shipped op lists and their entry counts

Importing this module reads no YAML and patches nothing; work starts when :func:`main` runs a subcommand.

Adding a subcommand
-------------------
A subcommand is a function ``add(subparsers)`` that calls ``subparsers.add_parser(NAME, help=...)``, adds its
arguments and sets ``parser.set_defaults(func=handler)``, where ``handler(args) -> int`` returns the exit status.

- Built into this module: write ``_add_NAME`` and list it in :data:`SUBCOMMANDS`.
- In its own module (preferred for anything heavy): give the module a top-level ``add_parser(subparsers)`` with
  the contract above and list the module in :data:`HOOKS`. The module is imported only when :func:`main` builds
  the parser, so keep its top-level imports cheap; a hook module that does not exist (yet) is skipped, one that
  fails to import is reported on stderr and skipped, so the other subcommands keep working.
"""
import argparse
import contextlib
import importlib
import logging
import os
import sys

# name -> add(subparsers); see "Adding a subcommand" above.
SUBCOMMANDS = {}

# Subcommand modules, imported lazily by build_parser(). Each defines add_parser(subparsers).
HOOKS = {
    "experiment": "amp_patch.tools.experiment",  # amp-patch experiment: fp32 vs O1/O2/O3 vs native autocast
    "run": "amp_patch.legacy",             # amp-patch run train.py: run an Apex script unchanged
    "trace": "amp_patch.tools.trace_cli",        # amp-patch trace: which ops ran in which dtype
    "doctor": "amp_patch.tools.doctor",         # amp-patch doctor: the op behind overflow, and its op-list fix
    "speed": "amp_patch.tools.speed",           # amp-patch speed: what holds a training step back, and the fixes
}


def add_verbose(parser):
    """``--verbose``: a job that raises gets its full traceback after the one-line error."""
    parser.add_argument("--verbose", action="store_true",
                        help="after a one-line error about the job, print the job's full traceback")


def error(command, exc, args=None):
    """Report a user mistake as ``amp-patch COMMAND: error: ...`` on stderr (the job's traceback too with
    ``--verbose``); returns exit status 2."""
    sys.stderr.write(f"amp-patch {command}: error: {exc}\n")
    details = getattr(exc, "details", "")
    if details and getattr(args, "verbose", False):
        sys.stderr.write(details if details.endswith("\n") else details + "\n")
    return 2


def job_raised(command, exc, args):
    """A job's own code raised while the command ran it: one line naming the job, the exception and the user's
    ``file:line`` (exit 2), or None when no frame of the traceback is the user's (an amp_patch bug: re-raise)."""
    from .experiment.models import job_error, user_frame
    if not getattr(args, "job", None) or user_frame(exc.__traceback__, users_only=True) is None:
        return None
    return error(command, job_error(args.job, "running it", exc), args)


def opt_level_hint(value):
    """The core's hint for a near-miss opt level (``" The first character is the digit zero; ..."``), or ""."""
    from ..config.opt_levels import check_opt_level
    from ..errors import ConfigError
    try:
        check_opt_level(value)
    except ConfigError as exc:
        return "." + str(exc).split(".", 1)[1] if "." in str(exc) else ""
    return ""


def opt_level_type(allowed):
    """An argparse ``type`` for ``--opt-level``: one of ``allowed``; a near miss (``01``, ``o1``, `` O1``) gets the
    core's hint (the digit zero, case, whitespace)."""
    def parse(value):
        from ..config.opt_levels import check_opt_level
        from ..errors import ConfigError
        try:
            level = check_opt_level(value)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(f"{value!r}; allowed: {', '.join(allowed)}."
                                             f"{str(exc).split('.', 1)[1] if '.' in str(exc) else ''}") from None
        if level not in allowed:
            raise argparse.ArgumentTypeError(f"{value!r}; allowed here: {', '.join(allowed)}")
        return level
    parse.__name__ = "opt level"
    return parse


class _HalfDtype(argparse.Action):
    """``--half-dtype``: any of config.dtypes.HALF_DTYPE_NAMES, stored as the canonical name; what the user
    typed is kept in ``half_dtype_given`` (see :func:`echo_half_dtype`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from ..config.dtypes import dtype_name, parse_half_dtype
        from ..errors import ConfigError
        try:
            dtype = parse_half_dtype(values, option_string)
        except ConfigError as exc:
            raise argparse.ArgumentError(self, f"{values!r}; {str(exc).split('; ', 1)[1]}") from None
        setattr(namespace, self.dest, dtype_name(dtype))
        namespace.half_dtype_given = values


def add_half_dtype(parser, default, why):
    """The ``--half-dtype`` option of a command: a name or a shorthand (fp16, bf16, 16, 16-mixed, bf16-mixed)."""
    parser.add_argument("--half-dtype", action=_HalfDtype, default=default, metavar="DTYPE",
                        help=f"float16 or bfloat16, or a shorthand: fp16/half/16/16-mixed, bf16/bf16-mixed "
                             f"(default {default}: {why})")


def echo_half_dtype(command, args):
    """One line on stderr when ``--half-dtype`` was a shorthand: the canonical name the command uses."""
    given = getattr(args, "half_dtype_given", None)
    if given is not None and given != args.half_dtype:
        sys.stderr.write(f"amp-patch {command}: --half-dtype {given} is {args.half_dtype}\n")


def run_threads(args, built_in_job):
    """``--threads`` as given, else 1 for a built-in job on the CPU (steadier timings), else None (torch's own):
    the rule the experiment and the speed report share."""
    if args.threads is not None:
        return args.threads
    return 1 if args.device == "cpu" and built_in_job else None


def _subcommand(name):
    def register(add):
        SUBCOMMANDS[name] = add
        return add
    return register


# ------------------------------------------------------------------------------------------------ validate

@_subcommand("validate")
def _add_validate(subparsers):
    parser = subparsers.add_parser(
        "validate", help="check op-list YAML files (or shipped list names)",
        description="Load each op list the way initialize(op_lists=...) would, resolving every entry against "
                    "the installed torch. Prints one summary line per list (entries per category) and the "
                    "version-dependent entries this torch skips. Errors go to stderr as 'path:line: message'. "
                    "Exit status: 0 when every list is valid, 1 otherwise.")
    parser.add_argument("specs", nargs="+", metavar="FILE_OR_NAME",
                        help="a YAML file, or a shipped list name (see 'amp-patch lists')")
    parser.add_argument("-q", "--quiet", action="store_true", help="print errors only")
    parser.add_argument("--job", metavar="MODULE:FUNCTION", default=None,
                        help="also check the lists' scopes: globs against this job's model (the experiment's job "
                             "convention: module:function from the current directory, or path/to/file.py:function)"
                             "; a glob matching no module is an error")
    add_verbose(parser)
    parser.set_defaults(func=_run_validate)
    return parser


def _spec_for(arg):
    """A bare name that is an existing file but not a shipped list is the file (``mylist`` -> ``./mylist``)."""
    from ..config.oplist import _looks_like_path, shipped_names
    if not _looks_like_path(arg) and arg not in shipped_names() and os.path.isfile(arg):
        return os.path.join(os.curdir, arg)
    return arg


def _counts_text(table):
    """``half 10, float 20, ...``; fp8 only where the list has some (then with its recipe)."""
    return ", ".join(f"{category} {count}" + (f" ({table.fp8_recipe})" if category == "fp8" else "")
                     for category, count in table.counts().items() if count or category != "fp8")


def _run_validate(args):
    from ..config.oplist import inactive_report, load_op_lists
    from ..errors import AmpPatchError, OpListError
    failed = 0
    model = _job_model(args) if args.job else None
    if model is False:
        return 2
    for arg in args.specs:
        try:
            table = load_op_lists(_spec_for(arg))
        except OpListError as exc:
            failed += 1
            print(str(exc), file=sys.stderr)  # already 'path:line: message'
            continue
        except AmpPatchError as exc:  # unreadable file, unknown shipped name
            failed += 1
            print(f"{arg}: {exc}", file=sys.stderr)  # a finding about this list, like its 'path:line:' ones
            continue
        if model is not None and not _scopes_match(arg, table, model):
            failed += 1
            continue
        if args.quiet:
            continue
        skipped = f"; {len(table.skipped)} skipped on torch {_torch_version()}" if table.skipped else ""
        scopes = f"; {len(table.scopes)} scope(s): {', '.join(s.glob for s in table.scopes)}" if table.scopes else ""
        print(f"{arg}: OK, {len(table)} entries ({_counts_text(table)}){skipped}{scopes}")
        for line in inactive_report(table):
            print(line)
    if failed:
        print(f"amp-patch validate: error: {failed} of {len(args.specs)} op list(s) invalid", file=sys.stderr)
    return 1 if failed else 0


def _job_model(args):
    """The model of ``--job`` (False, reported, when the job cannot be loaded or its model_fn raises)."""
    from ..errors import AmpPatchError
    from .experiment.models import call_job, load_job
    try:
        return call_job(args.job, load_job(args.job).model_fn)
    except AmpPatchError as exc:
        error("validate", exc, args)
        return False


def _scopes_match(arg, table, model):
    """Report each scopes: glob that matches no module of ``model``; True when every glob matches one."""
    from ..casting.scopes import unmatched_globs
    unmatched = unmatched_globs(table.scopes, [model])
    for scope in unmatched:
        print(f"{scope.path}:{scope.line}: scope {scope.glob!r} matches no module of the job's model "
              f"({type(model).__name__}); module paths are as model.named_modules() spells them", file=sys.stderr)
    return not unmatched


def _torch_version():
    import torch
    return torch.__version__


# ------------------------------------------------------------------------------------------------ lists

@_subcommand("lists")
def _add_lists(subparsers):
    parser = subparsers.add_parser("lists", help="list the shipped op lists with their entry counts",
                                   description="Print each shipped op list name (usable as op_lists=NAME, "
                                               "'extends: NAME' and 'amp-patch validate NAME') with its entries "
                                               "per category on this torch.")
    parser.add_argument("--patches", action="store_true",
                        help="instead, list the process-wide attributes amp_patch patches besides op-list sites")
    parser.set_defaults(func=_run_lists)
    return parser


def _run_lists(args):
    from ..config.oplist import inactive_report, load_op_lists, shipped_names
    from ..errors import AmpPatchError
    if args.patches:
        return _print_patch_catalogue()
    names = shipped_names()
    width = max((len(n) for n in names), default=0)
    status = 0
    for name in names:
        try:
            table = load_op_lists(name)
        except AmpPatchError as exc:
            print(str(exc), file=sys.stderr)
            status = 1
            continue
        inactive = f"; {len(table.skipped)} skipped on torch {_torch_version()}" if table.skipped else ""
        print(f"{name:<{width}}  {len(table):4d} entries ({_counts_text(table)}){inactive}")
        for line in inactive_report(table):
            print(line)
        print(_hybrid_split(table))
    return status


def _hybrid_split(table):
    """How the hybrid O1 engine splits ``table`` on this machine's device type (docs/architecture.md)."""
    from ..casting.interop.native_regions import engine_device_type
    from ..casting.native_plan import native_keys, off_entries

    devices = (engine_device_type(),)  # (a session uses its models' device type)
    native = native_keys(table, devices)
    off = off_entries(table, devices) if native else ()
    return (f"  hybrid engine ({'/'.join(devices)}): {len(native)} left to native autocast inside forwards, "
            f"{len(table) - len(native)} cast in Python there, {len(off)} more sites only turn native off")


def _print_patch_catalogue():
    from ..patching.registry import CATALOGUE
    print("Besides op-list sites, while a session (or an autocast() region) is open amp_patch patches:")
    for site, owner, why in CATALOGUE:
        print(f"- {site} ({owner}): {why}")
    return 0


# ------------------------------------------------------------------------------------------------ main

def build_parser():
    """The ``amp-patch`` parser: built-in subcommands, then those of the importable :data:`HOOKS` modules."""
    from .. import __version__
    parser = argparse.ArgumentParser(prog="amp-patch", description="amp_patch: Apex-style mixed precision "
                                     "for PyTorch driven by YAML op lists.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS.values():
        add(subparsers)
    for name, module_name in HOOKS.items():
        module = _import_hook(name, module_name)
        if module is not None:
            module.add_parser(subparsers)
    return parser


def _import_hook(name, module_name):
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            return None  # not written yet / not installed: no such subcommand
        return _hook_failed(name, module_name, exc)
    except Exception as exc:  # noqa: BLE001 - a broken optional module must not take 'validate' down with it
        return _hook_failed(name, module_name, exc)
    if not callable(getattr(module, "add_parser", None)):
        return _hook_failed(name, module_name, "it has no add_parser(subparsers)")
    return module


def _hook_failed(name, module_name, why):
    print(f"amp-patch: subcommand {name!r} unavailable: {module_name} failed to import ({why})", file=sys.stderr)
    return None


class _FallbackHandler(logging.StreamHandler):
    """amp_patch's INFO lines (configuration, overflows: what Apex printed) on stderr for command-line runs,
    but only while the program has not configured logging itself (then its handlers get them)."""

    def emit(self, record):
        if not logging.getLogger().handlers:
            super().emit(record)


@contextlib.contextmanager
def _show_amp_patch_logs():
    logger = logging.getLogger("amp_patch")
    handler = _FallbackHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    if level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def main(argv=None):
    """Run ``amp-patch`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Exit status 2 and one line on stderr for a user mistake (bad arguments, a missing script or job); a closed
    stdout (``amp-patch ... | head``) ends the command quietly.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, bad arguments: argparse has printed what it had to say
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        with _show_amp_patch_logs():
            status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's final flush
        return status
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:  # Ctrl-C in a command that does not handle it itself: one line, not a traceback
        sys.stderr.write(f"\namp-patch {args.command}: interrupted (Ctrl-C)\n")
        return 130


def _stdout_closed():
    """The reader of stdout went away: point stdout at /dev/null so the interpreter's final flush is quiet too."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real file descriptor (captured stdout): nothing to flush
        pass
    return 1


if __name__ == "__main__":  # pragma: no cover - python -m amp_patch.tools.cli
    sys.exit(main())
