"""The ``amp-patch experiment`` subcommand (``amp_patch.tools.cli`` calls ``add_parser``)."""
import argparse
import importlib.util
import os
import sys

from ...errors import AmpPatchError, ExperimentInterrupted
from ..cli import add_half_dtype, add_verbose, echo_half_dtype, error, run_threads
from .api import format_reports, run_experiment
from .models import BUILTIN, builtin_spec, load_job
from .report import JSON_NAME, PNG_NAME
from .variants import VARIANTS
from .verdict import LOSS_TOLERANCE

_EPILOG = """\
A --job function takes no arguments and returns a dict (or object) with model_fn(), optimizer_fn(model),
data_fn() (a Dataset or a tuple of tensors; items are (input, ..., target)) and loss_fn(output, target),
optionally batch_size and name (the report's title; default: the function's name, and jobs that share a name
add their MODULE:FUNCTION to it); the callables must be module-level. --job is repeatable. MODULE is imported
from the current directory first, then PYTHONPATH (as `python -m` does); --job path/to/jobs.py:FUNCTION loads a
file. A job that raises: one line naming it, the exception and your file:line (--verbose: the traceback).
Each table ends with a Verdict line. Ctrl-C keeps the finished rounds (printed, and in the JSON marked partial).
Exit status: 0 when every variant ran (a diverging variant is a result, not an error), 1 when a variant failed or
timed out, 2 on bad arguments or a job that raises, 130 after Ctrl-C."""


def add_parser(subparsers):
    """Add the ``experiment`` subcommand to an argparse ``subparsers`` object; returns its parser."""
    parser = subparsers.add_parser(
        "experiment", help="compare fp32, O1, O2, O3 and native autocast on a training job",
        description="Train the same job under fp32 (O0), O1, O2, O3 and native torch.autocast, each in its own "
                    "process with the same seed and data, and report step time, memory, loss, loss scale and "
                    "casts per variant (markdown on stdout, JSON and PNG in --out).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", metavar="MODULE:FUNCTION", action="append",
                        help="your own job (see below); repeatable: one table per job")
    parser.add_argument("--model", action="append", choices=sorted(BUILTIN) + ["all"],
                        help="built-in job on synthetic data; repeatable (default: all, unless --job is given)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per variant (default 40)")
    add_half_dtype(parser, "bfloat16", "see README, 'Half dtype'")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--variants", "--opt-level", "--opt-levels", nargs="+", default=[",".join(VARIANTS)],
                        metavar="VARIANT",
                        help=f"a subset of {','.join(VARIANTS)}, separated by commas or spaces (O0 is fp32; "
                             "--opt-level O1 O2 is the same option; default: all)")
    parser.add_argument("--op-lists", nargs="+", default=None, metavar="NAME_OR_FILE",
                        help="run O1 once per op list (shipped names or YAML files, e.g. apex torch_cpu fixed.yaml): "
                             "rows 'O1 [apex]', 'O1 [fixed.yaml]'; default: O1 with its default list")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5,
                        help="the timed steps are split into this many rounds; each round runs every variant in "
                             "turn, and the table shows the median over the rounds and their min-max (default 5)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="time limit per variant; a variant over it is killed and reported as 'timeout' "
                             "(default 600)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads per run (default: 1 for the built-in models on CPU, which are "
                             "too small to gain from more and time steadier on one; torch's default for --job)")
    _add_output_options(parser)
    parser.set_defaults(func=run_command)
    return parser


def _add_output_options(parser):
    """Where the report goes, how the command talks, and the verdict's tolerance."""
    parser.add_argument("--out", metavar="DIR", default=os.path.join(".", "experiment_out"),
                        help="where experiment.json and experiment.png go (default ./experiment_out)")
    parser.add_argument("--no-isolate", action="store_true",
                        help="run the variants one after the other in this process (debugging)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no starting line and no progress bar on stderr (the bar, with elapsed time and ETA, "
                             "shows only when stdout and stderr are terminals)")
    parser.add_argument("--loss-tolerance", type=float, default=LOSS_TOLERANCE, metavar="FRACTION",
                        help="the verdict's bound on a variant's loss gap to fp32, relative to fp32's loss at each "
                             f"step (default {LOSS_TOLERANCE:g}: within {LOSS_TOLERANCE * 100:g}%%)")
    add_verbose(parser)


def _jobs(args):
    models = args.model or ([] if args.job else ["all"])
    names = list(BUILTIN) if "all" in models else list(dict.fromkeys(models))
    jobs = [builtin_spec(name) for name in names]
    for spec in args.job or ():
        load_job(spec)  # fail early, with a clear message, before any variant runs
        jobs.append(spec)
    return jobs


def _variants(args):
    return ",".join(args.variants)


def run_command(args):
    """Run the experiment the parsed ``args`` describe; returns the exit status (130 after Ctrl-C)."""
    echo_half_dtype("experiment", args)
    _announce_png(args.out)
    jobs = []
    try:
        jobs = _jobs(args)
        reports = run_experiment(jobs, variants=_variants(args), steps=args.steps,
                                 half_dtype=args.half_dtype, device=args.device, seed=args.seed,
                                 out_dir=args.out, isolate=not args.no_isolate, progress=not args.no_progress,
                                 threads=run_threads(args, not args.job), rounds=args.rounds, timeout_s=args.timeout,
                                 loss_tolerance=args.loss_tolerance, op_lists=args.op_lists)
    except AmpPatchError as exc:
        return error("experiment", exc, args)
    except ExperimentInterrupted as stop:
        return _interrupted(args, stop.reports, len(stop.reports) < len(jobs))
    except KeyboardInterrupt:  # before any variant ran
        return _interrupted(args, [])
    _print_reports(reports)
    _wrote(args.out)
    failed = [v for r in reports for v in r["variants"].values() if v["status"] in ("failed", "timeout")]
    return 1 if failed else 0


def _print_reports(reports):
    if reports:
        sys.stdout.write(format_reports(reports) + "\n")
        sys.stdout.flush()


def _wrote(out):
    png = os.path.join(out, PNG_NAME)
    sys.stderr.write(f"wrote {os.path.join(out, JSON_NAME)}" + (f" and {png}\n" if _has_matplotlib() else "\n"))


def _interrupted(args, reports, jobs_left=False):
    """Ctrl-C: the finished rounds as a table, and one line saying where they were written; exit 130."""
    _print_reports(reports)
    sys.stderr.write(f"\namp-patch experiment: interrupted (Ctrl-C){_kept(args, reports, jobs_left)}\n")
    sys.stderr.flush()
    return 130


def _kept(args, reports, jobs_left=False):
    """What the interrupted experiment kept, in rounds (not variant-rounds) and finished variants; the JSON is
    marked partial only when something is missing (a variant's rounds, or a job that never ran)."""
    runs = [(len(v["rounds"]), r["rounds"], v["status"] != "interrupted") for r in reports
            for v in r["variants"].values()]
    if not any(done for done, _, _ in runs):
        return "; no round had finished"
    finished = sum(whole for _, _, whole in runs)
    stopped = [f"{done}/{planned}" for done, planned, whole in runs if not whole]
    where = f"written to {os.path.join(args.out, JSON_NAME)}"
    if not stopped:
        left = " (marked partial: jobs left to run)" if jobs_left else ""
        return f"; all {finished} variant run(s) had finished their rounds; {where}{left}"
    where += " (marked partial)"
    return (f"; {finished} of {len(runs)} variant run(s) finished all their rounds, the others stopped after "
            f"{', '.join(stopped)} round(s); {where}")


def _has_matplotlib():
    return importlib.util.find_spec("matplotlib") is not None


def _announce_png(out):
    if not _has_matplotlib():
        sys.stderr.write(f"amp-patch experiment: no {PNG_NAME} will be written to {out}: matplotlib is not "
                         "installed (pip install matplotlib); the table and the JSON are written as usual\n")
