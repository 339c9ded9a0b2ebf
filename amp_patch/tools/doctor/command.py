"""The ``amp-patch doctor`` subcommand (``amp_patch.tools.cli`` imports it lazily through its HOOKS)."""
import argparse
import json
import sys

from ...errors import AmpPatchError
from ..cli import add_half_dtype, add_verbose, echo_half_dtype, error, job_raised

_EPILOG = """\
The --job function follows the 'amp-patch experiment' convention (see amp_patch.tools.experiment.models).
Exit status: 0 when the job is healthy or a verified fix was found (and written with --out), 1 when the
failure is not fixable by op lists or the fix did not verify, 2 on bad arguments."""


def add_parser(subparsers):
    """Add ``doctor`` to an argparse ``subparsers`` object; returns its parser."""
    parser = subparsers.add_parser(
        "doctor", help="find the op behind overflow / NaN under O1 and write the op-list fix",
        description="Train the job under O1; if steps are skipped beyond the scaler's warm-up or the loss goes "
                    "non-finite, name the first op that leaves the half range (module, op, category, op-list "
                    "line), find the smallest float32 change (module scope first, then global) that removes it, "
                    "verify it by retraining, and print a report (markdown, or JSON with --json).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", metavar="MODULE:FUNCTION", required=True,
                        help="the training job: module:function (from the current directory first) or "
                             "path/to/file.py:function")
    parser.add_argument("--opt-level", default="O1",
                        help="the opt level diagnosed: only O1 (op lists act only under O1's per-op casting)")
    add_half_dtype(parser, "float16", "the dtype whose overflow the doctor diagnoses")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    parser.add_argument("--op-lists", metavar="NAME_OR_FILE", default=None,
                        help="the op list the job uses (default: apex); the written list extends it")
    parser.add_argument("--out", metavar="FILE", default=None, help="write the fixed op list (YAML) here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of markdown")
    add_verbose(parser)
    parser.set_defaults(func=run_command)
    return parser


def run_command(args):
    """Run the doctor for parsed ``args``; returns the exit status."""
    from .api import doctor
    echo_half_dtype("doctor", args)
    try:
        report = doctor(args.job, opt_level=args.opt_level, half_dtype=args.half_dtype, steps=args.steps,
                        op_lists=args.op_lists, out=args.out)
    except AmpPatchError as exc:
        return error("doctor", exc, args)
    except Exception as exc:  # noqa: BLE001 - the job's own code raised (else job_raised is None: re-raise)
        status = job_raised("doctor", exc, args)
        if status is None:
            raise
        return status
    text = json.dumps(report.as_dict(), indent=2, default=str) if args.json else report.to_markdown()
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return report.exit_code
