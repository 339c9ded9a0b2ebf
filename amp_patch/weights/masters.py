"""The two-copy layout's master weights of one optimizer: fp32 masters for its half params, kept in step with the
model. :class:`TwoCopyMasters` is a collaborator of :class:`~amp_patch.scaling.optimizer_state.OptimizerState`
(``state.masters``; None under the other layouts, which run none of this), with hooks named after the moments of
the loop: :meth:`attach` (initialize), :meth:`before_step`, :meth:`after_step`, :meth:`restore` (deinitialize)."""
import torch

from ..config.dtypes import HALF_DTYPES
from ..errors import UsageError
from .state_dict import carry_edits
from .storage import Fp32Masters


class TwoCopyMasters:
    """fp32 masters made per param group (:meth:`sync_groups`), their public views, and the sync at each step.

    The optimizer's ``param_groups`` hold the masters in place of the half model params, as Apex did; ``pairs``
    lists ``(half model param, fp32 master)``; ``storage`` keeps the masters between steps (fp32 tensors, or
    bf16 + int16 remainders: :mod:`amp_patch.weights.storage`)."""

    def __init__(self, optimizer, storage=None):
        self.optimizer = optimizer
        self.storage = storage or Fp32Masters()
        self.pairs = []  # (model param, fp32 master)
        self.ids = set()  # ids of the masters (their grads are not the model's)
        self.stale = False  # after a step: the next unscale writes the master grads instead of adding to them
        self._master_of = {}
        self._known_groups = 0
        self._param_count = 0

    # -- initialize ---------------------------------------------------------------------------------
    def attach(self, fp32_data=None):
        self.sync_groups(fp32_data or {})

    def sync_groups(self, fp32_data=None):
        """Give half params in (new) param groups an fp32 master; cheap when no group was added."""
        groups = self.optimizer.param_groups
        if len(groups) == self._known_groups:
            return
        if self._known_groups and not self.storage.persistent:
            raise UsageError(f"{type(self.optimizer).__name__}.add_param_group() after initialize(master_weights="
                             "'remainder'): the remainder masters are set up once, at initialize. Build the "
                             "optimizer with every param group before initialize, or use master_weights=True")
        for group in groups[self._known_groups:]:
            params = group["params"]
            for i, p in enumerate(params):
                if p.dtype in HALF_DTYPES and id(p) not in self._master_of:
                    params[i] = self._make_master(p, (fp32_data or {}).get(id(p)))
        self._known_groups = len(groups)
        self._param_count = sum(len(g["params"]) for g in groups)

    def _make_master(self, param, data):
        data = data if data is not None else param.detach().float()
        master = torch.nn.Parameter(data, requires_grad=param.requires_grad)
        state = self.optimizer.state
        if param in state:
            state[master] = state.pop(param)
        self.pairs.append((param, master))
        self._master_of[id(param)] = master
        self.ids.add(id(master))
        self.storage.adopt(param, master)
        return master

    # -- views ----------------------------------------------------------------------------------------
    def by_model_param(self):
        """id(model param) -> its master as state_dict()/deinitialize/the DDP helpers read and write it."""
        return {id(p): self.storage.public(p, m) for p, m in self.pairs}

    def public_pairs(self):
        """(model param, master as by_model_param gives it) for every half param."""
        return [(p, self.storage.public(p, m)) for p, m in self.pairs]

    def to_model(self, model_p, public_master):
        """The half value ``model_p`` gets from its master (the session's rounding rule)."""
        return self.storage.to_model(model_p, public_master)

    def out_of_sync(self, model_p, public_master):
        """Does ``model_p`` no longer hold what its master gives it (e.g. DDP broadcast rank 0's weights)?"""
        return self.storage.out_of_sync(model_p, public_master)

    # -- step ----------------------------------------------------------------------------------------
    def carry_edits(self, strict=True):
        """In-place edits of the half model since the last copy reach the masters (fp32 masters elementwise;
        remainder masters per param: see ``RemainderMasters.carry_edit``)."""
        if self.storage.persistent:
            carry_edits(self.pairs, strict, self.storage.to_model)
            return
        for model_p, master in self.pairs:
            self.storage.carry_edit(model_p, master)

    def groups_checked(self):
        """Remainder masters: refuse param groups whose params changed since initialize (cheap: counts). True
        when the check ran (remainder masters with pairs)."""
        if self.storage.persistent or not self.pairs:
            return False
        count = sum(len(g["params"]) for g in self.optimizer.param_groups)
        if count != self._param_count:
            raise UsageError(f"{type(self.optimizer).__name__}.param_groups hold {count} params, but "
                             f"{self._param_count} at initialize(master_weights='remainder'); the remainder "
                             "masters are set up once. Build the optimizer with every param before initialize, "
                             "or use master_weights=True")
        return True

    def check_backward_outside(self, pending, kept_model_grads):
        """Half model grads with no scale_loss pending come from a plain ``loss.backward()``."""
        kept = {id(grad) for _, grad in kept_model_grads}
        if pending is None and any(p.grad is not None and id(p.grad) not in kept for p, _ in self.pairs):
            raise UsageError(f"{type(self.optimizer).__name__}.step(): the half model params have gradients that "
                             "no amp_patch.scale_loss() block produced (a plain loss.backward()?); under master "
                             "weights (O2) those never reach the fp32 weights. Run backward inside "
                             "'with amp_patch.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()'.")

    def before_step(self):
        """The step is about to run on the masters (remainder storage joins them into fp32)."""
        self.storage.before_step(self.pairs)

    def after_step(self, skipped):
        """The step ran (or was skipped): the half model gets the masters' values; the master grads go (as in
        Apex: model-side zeroing never reaches them, so a master whose half param gets no grad in the next
        iteration's first backward would otherwise add the last iteration's grad)."""
        self.storage.after_step(self.pairs, skipped)
        for _, master in self.pairs:
            master.grad = None
        self.stale = bool(self.pairs)

    # -- deinitialize ------------------------------------------------------------------------------
    def restore(self):
        """The model params go back into param_groups, with the masters' optimizer state (the caller carried the
        last edits first: :meth:`carry_edits` with ``strict=False``)."""
        state = self.optimizer.state
        for param, master in self.pairs:
            if master in state:
                state[param] = state.pop(master)
            if master.grad is not None:
                param.grad = None
        model_of = {id(m): p for p, m in self.pairs}
        for group in self.optimizer.param_groups:
            group["params"] = [model_of.get(id(p), p) for p in group["params"]]
