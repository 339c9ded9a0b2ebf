"""The session: every piece of state one ``initialize`` call creates, and how to undo it."""
import logging

import torch

from ..casting.state import CastingState
from ..observe.state import ObserveState
from ..parallel.state import ParallelState
from ..scaling.state import ScalingState

log = logging.getLogger("amp_patch")


class Session:
    """One initialized amp_patch configuration: what ``initialize`` was given, one part per concern, the undo list.

    The parts (each owned by its package): ``casting`` (:class:`~amp_patch.casting.state.CastingState`: engine,
    model patches, early-bound routes), ``scaling`` (:class:`~amp_patch.scaling.state.ScalingState`: scalers,
    optimizer states), ``parallel`` (:class:`~amp_patch.parallel.state.ParallelState`: DDP/FSDP2), ``observe``
    (:class:`~amp_patch.observe.state.ObserveState`: history, overflow diagnosis), and ``extensions`` (what a
    layer above keeps: the apex alias). Every part's undo steps go into the one ordered ``undo`` list, appended as
    initialize acts, so ``close()`` undoes across parts in exactly the reverse order of doing.
    """

    def __init__(self, props=None, *, enabled=True):
        self.props = props
        self.enabled = enabled
        self.undo = []  # every part's undo callables, in the order of doing, run (newest first) by close()
        self.grad_enabled = None  # the grad mode close() leaves (set by initialize, else at the first close())
        self.models = []
        self.unreachable = []  # import-time bindings amp_patch cannot reach (reported)
        self.fp32_data = {}  # id(param) -> fp32 data of params cast without an optimizer (for attach_optimizers)
        self.casting = CastingState()
        self.scaling = ScalingState()
        self.parallel = ParallelState()
        self.observe = ObserveState()
        self.extensions = {}  # what a layer above keeps about this session (legacy.stacking: the apex.amp calls)

    def clear_cache(self):
        self.casting.clear_cache()

    def refresh_early_bound(self):
        """(Re)point early-bound function attributes of the models at the current wrappers."""
        self.casting.refresh_early_bound(self.models)

    def close(self):
        """Undo everything in reverse order of doing it (casting patches, optimizers, models, hooks).

        Every step runs even if another raises (an exception or a KeyboardInterrupt); the steps that failed stay
        in ``undo``, in order, so calling ``close()`` again retries just those, and the first failure is
        re-raised once the others have run. A step is forgotten only once it has run (an interrupt between
        two steps loses none), and the grad mode is put back whatever happened (an interrupt inside a step's
        ``torch.no_grad()`` could leave grads off).
        """
        if self.grad_enabled is None:
            self.grad_enabled = torch.is_grad_enabled()
        try:
            first = self._run_undo()
        finally:
            torch.set_grad_enabled(self.grad_enabled)
        if first is not None:
            log.warning("%d undo step(s) of amp_patch failed; call amp_patch.deinitialize() again to retry them",
                        len(self.undo))
            raise first
        self.scaling.reset()
        self.casting.reset()
        self.fp32_data = {}

    def _run_undo(self):
        """Run the undo steps newest first, each marked done (None) in place once it ran; the failed ones stay."""
        first = None
        for index in range(len(self.undo) - 1, -1, -1):
            step = self.undo[index]
            if step is None:
                continue
            try:
                step()
            except BaseException as exc:  # noqa: B036 - re-raised by close(), after the other undo steps
                first = first if first is not None else exc
                continue
            self.undo[index] = None
        self.undo = [step for step in self.undo if step is not None]
        return first

