"""What one session keeps about loss scaling: its ``scaling`` part (the scalers, one OptimizerState per optimizer).

Filled by ``initialize`` (``session.api``; ``attach_optimizers`` and the apex alias add optimizers later), which
registers each optimizer's :meth:`~.optimizer_state.OptimizerState.restore` in the session's one ordered undo list
before attaching it.
"""
from ..errors import UsageError


class ScalingState:
    """Scaling fields of one session."""

    def __init__(self):
        self.opt_states = {}  # id(optimizer) -> OptimizerState
        self.scalers = []  # one LossScaler per loss id

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

    def masters(self):
        """id(model param) -> fp32 master, over every optimizer."""
        found = {}
        for state in self.opt_states.values():
            found.update(state.masters_by_model_param())
        return found

    def reset(self):
        """After every undo step ran (each optimizer restored): forget the optimizers."""
        self.opt_states.clear()


def _suggest(loss_id, scalers):
    return loss_id + 1 if isinstance(loss_id, int) and loss_id >= len(scalers) else len(scalers)
