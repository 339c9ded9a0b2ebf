"""``amp-patch speed``: why isn't mixed precision faster? A measured report of what holds a training step back.

``speed_report(job)`` trains the job (the experiment's job convention, :mod:`amp_patch.tools.experiment.models`)
under one opt level with light instrumentation and returns a :class:`SpeedReport` whose findings are ranked by the
step time they cost, each with the measured figure, where it happens and a written fix. Kinds: ``data_loading``,
``host_sync``, ``alignment``, ``data_parallel``, ``casts``, ``optimizer``, ``hardware`` (see docs/speed.md).
``add_parser`` adds the ``speed`` subcommand to the ``amp-patch`` CLI.
"""
from .api import speed_report
from .command import add_parser, run_command
from .findings import THRESHOLDS, Finding
from .report import SpeedReport

__all__ = ["speed_report", "SpeedReport", "Finding", "THRESHOLDS", "add_parser", "run_command"]
