"""The bytes a variant keeps for training: weights, gradients and optimizer state (masters kept beside the
weights, as remainder masters' int16 halves, included), counted from tensor storages, each storage once.

Process RSS growth mixes these with the allocator, caches and libraries; this count is what opt levels and master
storages actually change (an fp32 weight 4 bytes, a float16 one 2, its fp32 master 4 more).
"""
import torch

from ...session import state as _state


def state_mib(model, optimizer):
    """MiB of the distinct storages behind ``model``'s params and grads, ``optimizer``'s params, grads and state,
    and the active amp_patch session's master storages."""
    tensors = []
    for p in model.parameters():
        tensors += [p, p.grad]
    for group in optimizer.param_groups:
        for p in group["params"]:
            tensors += [p, p.grad]
    for per_param in optimizer.state.values():
        tensors += list(per_param.values()) if isinstance(per_param, dict) else [per_param]
    tensors += _session_masters()
    return _distinct_bytes(tensors) / 2 ** 20


def _session_masters():
    """The tensors the active session keeps beside the optimizer (remainder masters' int16 halves)."""
    session = _state.current()
    found = []
    for opt_state in getattr(getattr(session, "scaling", None), "opt_states", {}).values():
        remainders = getattr(opt_state.storage, "remainders", None)
        if isinstance(remainders, dict):
            found += list(remainders.values())
    return found


def _distinct_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if not torch.is_tensor(t) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr(), storage.nbytes())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total
