"""The session: every piece of state one ``initialize`` call creates, and how to undo it."""
import logging

import torch

from ..errors import UsageError
from ..patching import early_bound

log = logging.getLogger("amp_patch")


class Session:
    """One initialized amp_patch configuration (models, optimizers, scalers, casting engine)."""

    def __init__(self, props=None, *, enabled=True):
        self.props = props
        self.enabled = enabled
        self.engine = None
        self.model_patches = []
        self.opt_states = {}
        self.scalers = []
        self.undo = []  # extra callables run (newest first) by close()
        self.grad_enabled = None  # the grad mode close() leaves (set by initialize, else at the first close())
        self.models = []
        self.rerouted = []  # early-bound module attributes routed through the wrappers
        self._early_undo = None
        self.history = None  # diagnostics.StepHistory
        self.diagnoser = None  # diagnostics.OverflowDiagnoser (diagnose_overflow=True)
        self.last_overflow = None
        self.no_sync_depth = 0  # open DistributedDataParallel.no_sync() regions (O2: unscale deferred inside)
        self.unsharded_models = []  # not FSDP2-sharded at initialize: a later fully_shard is refused
        self.fsdp_groups = []  # FSDP2 param groups of the models (set_requires_gradient_sync(False) delays unscale)
        self.fsdp_held = None  # (scaler, loss id) of the grads FSDP2 accumulates unreduced (no gradient sync)
        self.masters_checked = False  # the one-time DDP master-weight check of scale_loss
        self.unreachable = []  # import-time bindings amp_patch cannot reach (reported)
        self.fp32_data = {}  # id(param) -> fp32 data of params cast without an optimizer (for attach_optimizers)
        self.extensions = {}  # what a layer above keeps about this session (legacy.stacking: the apex.amp calls)

    def scaler(self, loss_id):
        if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < len(self.scalers):
            raise UsageError(f"loss_id={loss_id!r}, but initialize(num_losses={len(self.scalers)}) created loss "
                             f"ids 0..{len(self.scalers) - 1}; pass num_losses={_suggest(loss_id, self.scalers)} "
                             "to initialize or use an existing loss id")
        return self.scalers[loss_id]

    def state_for(self, optimizer):
        state = self.opt_states.get(id(optimizer))
        if state is None or state.optimizer is not optimizer:
            raise UsageError(f"{type(optimizer).__name__} optimizer was not passed to amp_patch.initialize(); pass "
                             "every optimizer whose gradients you scale: initialize(model, [opt1, opt2], ...)")
        return state

    def clear_cache(self):
        if self.engine is not None:
            self.engine.clear_cache()

    def refresh_early_bound(self):
        """(Re)point early-bound function attributes of the models at the current wrappers."""
        self.drop_early_bound()
        self._early_undo, self.rerouted = early_bound.reroute(self.models, self.engine)

    def drop_early_bound(self):
        undo, self._early_undo = self._early_undo, None
        if undo is not None:
            undo()

    def masters(self):
        """id(model param) -> fp32 master, over every optimizer."""
        found = {}
        for state in self.opt_states.values():
            found.update(state.masters_by_model_param())
        return found

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
        self.opt_states.clear()
        self.model_patches.clear()
        self.fp32_data = {}
        self.engine = None

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


def _suggest(loss_id, scalers):
    return loss_id + 1 if isinstance(loss_id, int) and loss_id >= len(scalers) else len(scalers)
