"""What one session keeps for diagnostics (the step history, the overflow diagnoser): its ``observe`` part.

Set up by ``initialize`` (``session.api._set_up_diagnostics``, which registers the diagnoser's ``remove`` as this
part's undo step in the session's one ordered undo list), written by ``scale_loss``'s scaler update
(:mod:`amp_patch.session.scale_loss`), read by ``amp_patch.history()`` / ``amp_patch.last_overflow()``.
"""


class ObserveState:
    """Diagnostics fields of one session."""

    def __init__(self):
        self.history = None  # overflow.StepHistory
        self.diagnoser = None  # overflow.OverflowDiagnoser (diagnose_overflow=True)
        self.last_overflow = None  # the diagnoser's latest record (amp_patch.last_overflow())
