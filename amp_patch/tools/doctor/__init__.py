"""``amp_patch.doctor``: find the op behind persistent overflow and write the op-list fix.

``doctor(job)`` trains the job under O1 (the experiment's job convention, :mod:`amp_patch.tools.experiment.models`).
If a step is skipped for a reason other than the scaler's warm-up, or the loss goes non-finite, it replays the
first failing batch from the weights that failed, finds the first op whose output (or output gradient) leaves
the half range, forces candidates to float32 (the op's innermost module as a scope first, then globally) until
the replay is clean, keeps the smallest set that suffices, and verifies it by retraining (no skipped step after
warm-up; final loss against a float32 run). ``add_parser`` adds ``amp-patch doctor`` to the CLI.
"""
from .api import DoctorReport, doctor
from .command import add_parser, run_command

__all__ = ["doctor", "DoctorReport", "add_parser", "run_command"]
