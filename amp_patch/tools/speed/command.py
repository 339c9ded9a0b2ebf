"""The ``amp-patch speed`` subcommand (``amp_patch.tools.cli`` imports it lazily through its HOOKS)."""
import argparse
import sys

from ...errors import AmpPatchError
from ..cli import add_half_dtype, add_verbose, echo_half_dtype, error, job_raised, opt_level_type, run_threads

#: the job run when --job is not given: the experiment's built-in MLP
DEFAULT_JOB = "amp_patch.tools.experiment.models:mlp"

_EPILOG = """\
The --job function follows the 'amp-patch experiment' convention (see amp_patch.tools.experiment.models); its
data_fn may return a DataLoader, used as built (its num_workers and pin_memory are yours).
Exit status: 0 when the report was made (findings are results, not errors), 2 on bad arguments or a job that
raises (one line naming your file:line; --verbose adds the traceback), 130 after Ctrl-C."""


def add_parser(subparsers):
    """Add ``speed`` to an argparse ``subparsers`` object; returns its parser."""
    parser = subparsers.add_parser(
        "speed", help="why isn't it faster? rank what holds a training step back, with fixes",
        description="Train the job under one opt level with light instrumentation and print what holds its step "
                    "back, ranked by the step time it costs, each with the measured figure, where it happens and "
                    "a fix: data loading, host reads of tensor values (device syncs), layer sizes not multiples "
                    "of 8, DataParallel, casts, the optimizer step, no half-precision hardware.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", metavar="MODULE:FUNCTION", default=DEFAULT_JOB,
                        help="the training job: module:function (from the current directory first) or "
                             f"path/to/file.py:function (default {DEFAULT_JOB}, the experiment's built-in MLP)")
    parser.add_argument("--opt-level", type=opt_level_type(("O0", "O1", "O2", "O3")), default="O1",
                        help="the opt level the steps run under (default O1)")
    add_half_dtype(parser, "bfloat16", "as the experiment; see README, 'Half dtype'")
    parser.add_argument("--steps", type=int, default=20,
                        help="training steps: 2 warm-up, 4 probe, the rest plain and timed in turn (default 20)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for the run (default: 1 for the built-in job on CPU, as the "
                             "experiment; torch's own default for your job). Step times and findings depend on it")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="also write the report as JSON: {\"findings\": [{\"kind\", \"share\", \"where\", "
                             "\"figure\", \"fix\"}], \"step_ms\", \"machine\", ...}")
    add_verbose(parser)
    parser.set_defaults(func=run_command)
    return parser


def run_command(args):
    """Make the speed report for parsed ``args``; returns the exit status."""
    from .api import speed_report
    echo_half_dtype("speed", args)
    try:
        report = speed_report(args.job, opt_level=args.opt_level, half_dtype=args.half_dtype, steps=args.steps,
                              device=args.device, seed=args.seed,
                              threads=run_threads(args, args.job == DEFAULT_JOB))
    except AmpPatchError as exc:
        return error("speed", exc, args)
    except Exception as exc:  # noqa: BLE001 - the job's own code raised (else job_raised is None: re-raise)
        status = job_raised("speed", exc, args)
        if status is None:
            raise
        return status
    sys.stdout.write(report.to_text() + "\n")
    sys.stdout.flush()
    if args.json:
        try:
            report.write_json(args.json)
        except OSError as exc:
            return error("speed", f"cannot write --json {args.json!r}: {exc}", args)
        sys.stderr.write(f"wrote {args.json}\n")
    return 0
