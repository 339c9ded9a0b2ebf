"""Optimizer state that exists before ``initialize`` (a loaded checkpoint, an earlier session) in another floating
dtype than its param: O3 casts the params to half, and torch's optimizers refuse fp32 moments of a half param (a
raw dtype error at the first step). The state gets the param's dtype, as a fresh state would have; deinitialize
gives back the very tensors it held where no step changed them since (else the current values in the old dtype).
"""
import torch


def cast_state_to_params(optimizer):
    """Cast ``optimizer.state`` tensors shaped like their param to its dtype; returns what :func:`uncast_state`
    needs: ``[(state, key, tensor before, its cast, the cast's version)]``."""
    casts = []
    for p, st in optimizer.state.items():
        if not isinstance(p, torch.Tensor) or not isinstance(st, dict) or not p.is_floating_point():
            continue
        for key, value in list(st.items()):
            if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != p.dtype
                    and value.shape == p.shape):
                cast = value.to(p.dtype)
                st[key] = cast
                casts.append((st, key, value, cast, cast._version))
    return casts


def uncast_state(casts):
    """Undo :func:`cast_state_to_params` (newest first; a value replaced since is left alone)."""
    while casts:
        st, key, before, cast, version = casts.pop()
        if st.get(key) is cast:
            st[key] = before if cast._version == version else cast.to(before.dtype)
