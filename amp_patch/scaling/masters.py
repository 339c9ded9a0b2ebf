"""The two-copy layout's master weights of one optimizer: fp32 masters for its half params, kept in step with the
model. A mixin of :class:`~.optimizer_state.OptimizerState`, which owns the fields these methods read and write
(``pairs``, ``_master_of``, ``_master_ids``, ``storage``, ``_known_groups``, ``_param_count``)."""
import torch

from ..config.dtypes import HALF_DTYPES
from ..errors import UsageError
from ..model.transform import carry_edits


class MasterWeights:
    """Masters made per param group (``_sync_groups``), their public views, and the sync at each step."""

    def _sync_groups(self, fp32_data=None):
        """Give half params in (new) param groups an fp32 master; cheap when no group was added."""
        groups = self.optimizer.param_groups
        if not self.master_weights or len(groups) == self._known_groups:
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
        self._master_ids.add(id(master))
        self.storage.adopt(param, master)
        return master

    def masters_by_model_param(self):
        """id(model param) -> its master as state_dict()/deinitialize/the DDP helpers read and write it."""
        return {id(p): self.storage.public(p, m) for p, m in self.pairs}

    def public_pairs(self):
        """(model param, master as masters_by_model_param gives it) for every half param."""
        return [(p, self.storage.public(p, m)) for p, m in self.pairs]

    def to_model(self, model_p, public_master):
        """The half value ``model_p`` gets from its master (the session's rounding rule)."""
        return self.storage.to_model(model_p, public_master)

    def out_of_sync(self, model_p, public_master):
        """Does ``model_p`` no longer hold what its master gives it (e.g. DDP broadcast rank 0's weights)?"""
        return self.storage.out_of_sync(model_p, public_master)

    def master_params(self):
        self._sync_groups()
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def _clear_master_grads(self):
        """After every step the fp32 master grads go (as in Apex): model-side zeroing (``p.grad = None`` on the
        model's params, ``model.zero_grad()``) never reaches them, so a master whose half param gets no grad
        in the next iteration's first backward would otherwise add the last iteration's grad."""
        for _, master in self.pairs:
            master.grad = None

    def _carry_edits(self, strict=True):
        """In-place edits of the half model since the last copy reach the masters (fp32 masters elementwise;
        remainder masters per param: see ``RemainderMasters.carry_edit``)."""
        if self.storage.persistent:
            carry_edits(self.pairs, strict, self.storage.to_model)
            return
        for model_p, master in self.pairs:
            self.storage.carry_edit(model_p, master)

    def _check_groups_unchanged(self):
        """Remainder masters: refuse param groups whose params changed since initialize (cheap: counts)."""
        if self.storage.persistent or not self.pairs:
            return
        count = sum(len(g["params"]) for g in self.optimizer.param_groups)
        if count != self._param_count:
            raise UsageError(f"{type(self.optimizer).__name__}.param_groups hold {count} params, but "
                             f"{self._param_count} at initialize(master_weights='remainder'); the remainder "
                             "masters are set up once. Build the optimizer with every param before initialize, "
                             "or use master_weights=True")
