"""The two-copy layout's state-dict hooks and edit carrying: a model's ``state_dict()`` holds the fp32 masters,
``load_state_dict()`` writes them, and in-place edits of the half model params reach the masters."""
import torch

from .._torch.hooks import SessionHook
from ..errors import UsageError


class StateDictHook(SessionHook):
    """state_dict post-hook: what amp_patch cast, in its original dtype (the master where there is one, with the
    in-place edits of the half model since the last step carried into it: see :func:`carry_edits`)."""

    def __init__(self, restored, to_model=None):
        self.restored = restored  # (name, original dtype, master or None, param)
        self.to_model = to_model  # (param, master) -> the half value the param got from its master (None: a cast)

    def __call__(self, module, state_dict, prefix, local_metadata):
        carry_edits([(param, master) for _, _, master, param in self.restored if isinstance(master, torch.Tensor)],
                    strict=False, to_model=self.to_model)
        for name, dtype, master, _ in self.restored:
            value = state_dict.get(prefix + name)
            if master is not None:
                state_dict[prefix + name] = master.detach()
            elif isinstance(value, torch.Tensor) and value.dtype is not dtype:
                state_dict[prefix + name] = value.detach().to(dtype)


class LoadMastersHook(SessionHook):
    """load_state_dict pre-hook: loading also writes the masters (in place, so tied params stay tied)."""

    def __init__(self, restored, to_model=None):
        self.restored = restored
        self.to_model = to_model  # (param, master) -> the half value the param gets (None: torch's cast of the value)

    def __call__(self, module, state_dict, prefix, *unused):
        with torch.no_grad():
            for name, _, master, param in self.restored:
                value = state_dict.get(prefix + name)
                if master is not None and isinstance(value, torch.Tensor) and value.shape == master.shape:
                    master.copy_(value)
                    if self.to_model is not None:
                        state_dict[prefix + name] = self.to_model(param, master)


def carry_edits(pairs, strict=True, to_model=None):
    """Master weights (O2): carry into the fp32 masters what changed in the half model params since the masters
    were last copied into them (WGAN's ``p.data.clamp_(-c, c)``, weight surgery through ``.data``), elementwise,
    so the next step does not silently undo it. Called before each step and at deinitialize (``strict=False``:
    a param whose shape changed is left to its master); unchanged params cost one compare. ``to_model(param,
    master)``: the half value the param got from its master (default torch's cast; ``master_rounding="split"``
    rounds ties otherwise, and a tie must not read as an edit)."""
    with torch.no_grad():
        for param, master in pairs:
            if param.shape != master.shape and not strict:
                continue
            if param.shape != master.shape:
                raise UsageError(
                    f"a {param.dtype} model param changed shape from {tuple(master.shape)} to {tuple(param.shape)} "
                    "since initialize; its fp32 master (in amp_patch.master_params(optimizer)) cannot follow. "
                    "Resize the model before amp_patch.initialize(), or edit the masters (and build a new "
                    "optimizer and session) instead")
            rounded = master.to(param.dtype) if to_model is None else to_model(param, master)
            bits, rounded_bits = _bits(param), _bits(rounded)  # (bitwise: a NaN weight is no edit)
            if torch.equal(bits, rounded_bits):
                continue
            master.copy_(torch.where(bits != rounded_bits, param.to(master.dtype), master))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.element_size() in _INT_OF_SIZE else t
