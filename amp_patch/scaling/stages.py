"""The named stages of the per-iteration scale_loss protocol of one optimizer (the state machine is drawn in
:mod:`.optimizer_state`'s docstring), as torch's ``GradScaler`` names its ``OptState``.

Two independent stages: where the grads stand (:class:`Grads`, with :class:`Scaled` as the data of ``SCALED``) and
what the coming ``step()`` does (:class:`NextStep`). They are independent because a step doomed by one loss's
overflow still gets the next loss's scaled grads (``DOOMED`` and ``SCALED`` at once).
"""
import enum


class Grads(enum.Enum):
    """Where the grads of the optimizer's params stand."""

    UNSCALED = "unscaled"  # at their true scale (or none): what step() may use
    SCALED = "scaled"  # multiplied by ``pending.scale``, ``pending.scaler``'s (inside scale_loss, or delay_unscale)


class NextStep(enum.Enum):
    """What the coming ``optimizer.step()`` does."""

    READY = "ready"  # it runs
    DOOMED = "doomed"  # an overflow since the last step: it is skipped (every grad hidden for its duration)


# The members as module constants: reading ``NextStep.DOOMED`` goes through the enum class (about 0.2 us on
# Python 3.11), and the protocol compares stages a few times per scale_loss.
UNSCALED, SCALED = Grads.UNSCALED, Grads.SCALED
READY, DOOMED = NextStep.READY, NextStep.DOOMED


class Scaled:
    """The data of ``Grads.SCALED``: which scaler's scale the grads carry, the scale itself (the scaler's when its
    loss was scaled: another block's exit may change the scaler's since, amp_patch's API unscales by this one), and
    what they went through so far. (``GradProtocol.open_block`` builds its usual one without ``__init__``: a field
    added here goes there too.)"""

    __slots__ = ("scaler", "scale", "inf_seen", "unreduced")

    def __init__(self, scaler, unreduced=False):
        self.scaler = scaler
        self.scale = scaler.scale
        self.inf_seen = False  # an earlier scale of these grads (another loss's) was unscaled or rescaled: inf/NaN?
        self.unreduced = unreduced  # accumulated inside DDP no_sync(): rescaled in place, never out of param.grad


class NextStepStage:
    """The ``NextStep`` stage of :class:`~.optimizer_state.OptimizerState` and its transitions (a mixin)."""

    def _init_next_step(self):
        self.next_step = READY
        self.doomed_by = None  # the scaler that doomed a step, until Apex's skip message names its loss (or zero_grad)
        self.last_skipped = False  # the outcome of the last step() (amp_patch.last_step_skipped)

    def doom(self, by=None):
        """READY -> DOOMED: an overflow was counted; ``by`` (the overflowing loss's scaler) is named only when this
        dooms the step (an already doomed step keeps its first doomer)."""
        if self.next_step is READY:
            self.next_step = DOOMED
            if by is not None:
                self.doomed_by = by

    def _pardon(self):
        """DOOMED -> READY (called in DOOMED) at a scale_loss entry that finds no grad: they were cleared since the
        overflow, nothing is left to skip."""
        if not self._any_grad():
            self.next_step = READY

    def _take_step(self):
        """step() begins: the stage becomes READY again; returns (and records) whether this step is skipped."""
        self.last_skipped = self.next_step is DOOMED
        self.next_step = READY
        return self.last_skipped
