"""``amp-patch trace``: one training iteration of a job under an opt level, with the cast trace printed.

Jobs follow the experiment runner's convention (``amp_patch.tools.experiment.models``): ``--job module:function``
or a built-in ``--model``.
"""
import contextlib
import json

import torch

from ..config.dtypes import parse_half_dtype
from ..errors import AmpPatchError
from .cli import add_half_dtype, add_verbose, echo_half_dtype, error, job_raised, opt_level_type


def add_parser(subparsers):
    parser = subparsers.add_parser("trace", help="print which ops ran in which dtype for one iteration of a job",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--job", help="module:function (from the current directory first) or path/to/file.py:function "
                        "returning a job (see amp_patch.tools.experiment.models)")
    parser.add_argument("--model", default="transformer", help="built-in job when --job is not given "
                        "(mlp, cnn, transformer; default transformer)")
    parser.add_argument("--opt-level", default="O1", type=opt_level_type(("O1",)), help="tracing needs O1's patches")
    add_half_dtype(parser, "bfloat16", "as amp-patch experiment; see README, 'Half dtype'")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the iteration runs "
                        "(default cpu)")
    parser.add_argument("--op-lists", default=None,
                        help="shipped list name or YAML path (default: initialize's, the model's device's torch list)")
    parser.add_argument("--no-modules", action="store_true", help="do not attribute calls to modules")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    add_verbose(parser)
    parser.set_defaults(func=run_command)
    return parser


def _job(args):
    from .experiment.models import BUILTIN, load_job

    if args.job:
        return load_job(args.job)
    if args.model not in BUILTIN:
        raise AmpPatchError(f"--model {args.model!r}; allowed: {', '.join(BUILTIN)}")
    return BUILTIN[args.model]()


def check_device(device):
    """``device`` ("cpu", "cuda"), refused with the fix where this machine's torch has no CUDA."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise AmpPatchError(f"--device {device}, but torch.cuda.is_available() is False on this machine (torch "
                            f"{torch.__version__}); use --device cpu, or install a CUDA build of torch on a machine "
                            "with an NVIDIA GPU")
    return torch.device(device)


def trace_one_iteration(job, *, half_dtype=torch.bfloat16, op_lists=None, modules=True, device="cpu"):
    """Run one forward/backward/step of ``job`` under O1, its forward and backward inside ``amp_patch.trace()``;
    returns the tracer. amp_patch's own work is not listed: the unscale and finiteness check as ``scale_loss``
    exits, and the optimizer's step (casting is paused inside ``step()``)."""
    import amp_patch

    device = check_device(device)
    torch.manual_seed(0)
    model = job.model_fn().to(device)
    optimizer = job.optimizer_fn(model)
    data = job.data_fn()
    batch = tuple(t[: job.batch_size] for t in data) if isinstance(data, tuple) else next(iter(
        torch.utils.data.DataLoader(data, batch_size=job.batch_size)))
    batch = [t.to(device) if torch.is_tensor(t) else t for t in batch]
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O1", half_dtype=half_dtype,
                                            op_lists=op_lists, verbosity=0)
    try:
        with contextlib.ExitStack() as tracing:
            tracer = tracing.enter_context(amp_patch.trace(modules=modules))
            loss = job.loss_fn(model(*batch[:-1]), batch[-1])
            with amp_patch.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
                tracing.close()  # before scale_loss exits: its unscale and finiteness check are amp_patch's work
        optimizer.step()
        return tracer
    finally:
        amp_patch.deinitialize()


def run_command(args):
    echo_half_dtype("trace", args)
    try:
        check_device(args.device)
        tracer = trace_one_iteration(_job(args), half_dtype=parse_half_dtype(args.half_dtype), op_lists=args.op_lists,
                                     modules=not args.no_modules, device=args.device)
    except AmpPatchError as exc:
        return error("trace", exc, args)
    except Exception as exc:  # noqa: BLE001 - the job's own code raised (else job_raised is None: re-raise)
        status = job_raised("trace", exc, args)
        if status is None:
            raise
        return status
    if args.json:
        print(json.dumps(json.loads(tracer.to_json()), indent=2))
    else:
        print(tracer.to_markdown())
    return 0
