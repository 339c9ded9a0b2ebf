"""``amp-patch experiment``: which opt level suits a model, and what does it cost?

``compare(model_fn, optimizer_fn, data_fn, loss_fn, ...)`` trains one job under fp32 (O0), O1, O2, O3 and
native ``torch.autocast`` (+ ``GradScaler`` for float16), each variant in its own process with the same
seed and data, and reports per variant the median step time (and its ratio to fp32 and to native
autocast), peak memory, final loss and the largest deviation of the loss curve from fp32, skipped steps,
the final loss scale, casts per iteration and host-device syncs per step. ``add_parser`` adds the
``experiment`` subcommand to the ``amp-patch`` CLI. The job convention is documented in
:mod:`amp_patch.tools.experiment.models`.
"""
from .api import compare, format_reports, run_experiment
from .command import add_parser, run_command
from .models import BUILTIN, Job, load_job
from .variants import VARIANTS

__all__ = ["compare", "run_experiment", "format_reports", "add_parser", "run_command", "Job", "load_job",
           "BUILTIN", "VARIANTS"]
