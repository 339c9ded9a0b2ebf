"""``amp-patch run script.py [args...]``: run an Apex script unmodified, with the ``apex`` alias installed."""
import argparse
import importlib.util
import os
import runpy
import sys

from ..errors import AmpPatchError
from ..session import api as frontend
from .alias import install_apex_alias

_EPILOG = """\
The script runs as __main__ with sys.argv = [script.py, args...], exactly as `python script.py args...`
would run it, except that `import apex` / `from apex import amp` (and the other apex modules amp_patch
provides, see docs/migration.md) resolve to amp_patch. With torchrun:
  torchrun --nproc_per_node=2 -m amp_patch run train.py --opt-level O1
Exit status: the script's (SystemExit code, 0 when it returns, 1 on an uncaught exception); 2 with one line on
stderr when the script or module is not found or a real apex.amp is installed (see --force)."""


def add_parser(subparsers):
    """Add the ``run`` subcommand to an argparse ``subparsers`` object; returns its parser."""
    parser = subparsers.add_parser(
        "run", help="run an Apex script (from apex import amp) unmodified on amp_patch",
        description="Run a training script written for NVIDIA Apex's amp (removed from Apex in May 2025) on "
                    "amp_patch, without editing it: `import apex.amp` and `from apex import amp` get amp_patch's "
                    "Apex-compatible API, and the apex modules amp_patch provides (apex.parallel, apex.optimizers, "
                    "apex.fp16_utils, ..., amp_C, apex_C) are importable; importlib.metadata sees an apex "
                    "distribution. A real apex package keeps working: only what it lacks is added.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true",
                        help="use amp_patch's apex.amp even if a real apex.amp is installed")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="the target is a module name, run like `python -m MODULE`")
    parser.add_argument("target", metavar="script.py", help="the script (or, with -m, the module) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(func=run_command)
    return parser


def run_command(args):
    """The ``run`` subcommand: returns the script's exit status (2 when it cannot start)."""
    problem = _cannot_start(args.target, args.module)
    if problem is None:
        try:
            alias = install_apex_alias(force=args.force)  # refuses before the script runs when apex.amp is real
        except AmpPatchError as exc:
            problem = str(exc)
        else:
            alias.uninstall()
    if problem is not None:
        sys.stderr.write(f"amp-patch run: error: {problem}\n")
        return 2
    return run_script(args.target, args.args, force=args.force, module=args.module)


def _cannot_start(target, module):
    """Why ``target`` cannot run (a one-line message), or None."""
    if not module:
        return None if os.path.isfile(target) else f"no such script: {target!r}"
    sys.path.insert(0, os.getcwd())  # what `python -m` searches first
    try:
        found = importlib.util.find_spec(target) is not None
    except (ImportError, ValueError):  # a missing parent package, or a malformed name
        found = False
    finally:
        sys.path.pop(0)
    return None if found else f"no module named {target!r} (searched the current directory and sys.path)"


def run_script(target, argv=(), *, force=False, module=False):
    """Run ``target`` (a path, or a module name with ``module=True``) as ``__main__`` under the alias.

    Returns the exit status (SystemExit's code, 0 when the script returns);
    other exceptions propagate. ``sys.argv``, ``sys.path`` and the alias are
    restored afterwards, and amp_patch is deinitialized if the script left it on.
    """
    if not module and not os.path.exists(target):
        raise FileNotFoundError(f"amp-patch run: no such script: {target!r}")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [target, *argv]
    sys.path.insert(0, os.getcwd() if module else os.path.dirname(os.path.abspath(target)))
    try:
        with install_apex_alias(force=force):
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        return _exit_status(exc.code)
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        frontend.deinitialize()
    return 0


def _exit_status(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")  # what the interpreter does with sys.exit("message")
    return 1


def main(argv=None):
    """``python -m amp_patch.legacy run script.py ...`` (the same as ``amp-patch run``)."""
    parser = argparse.ArgumentParser(prog="python -m amp_patch.legacy",
                                     description="amp_patch's Apex compatibility commands")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_parser(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)
