"""A checkpointed segment recomputes inside the O2 call its forward ran in.

``torch.utils.checkpoint`` runs the segment's function again during backward, after the model's call returned: its
compute copies are gone, so a segment that reads a param whose module is not called inside it (a method of the
model reading ``self.weight``; a ``TransformerEncoderLayer`` whose inner modules have no hooks of their own)
would recompute on the fp32 params (reentrant: grads silently off; non-reentrant: torch's ``CheckpointError``, or
a dtype error). While an O2 session with compute copies is open, the function handed to the reentrant path
(``CheckpointFunction.apply``) and to the non-reentrant one (``_checkpoint_without_reentrant_generator``) is
wrapped: ``checkpoint()`` notes the O2 calls in progress in its thread, and each run of the function outside them
re-enters them (:meth:`~.compute_copies.ComputeCopies.reenter`: fresh copies, the same values, each param cast once
per recomputation, grads into the fp32 params). The same sites as the O1 engine's (``casting/interop/recompute``):
either patch wraps whatever the other left there.
"""
import contextlib
import functools
import sys

import torch.utils.checkpoint as _ckpt

from .._torch import compat
from ..weights import compute_copies


def install(patcher):
    """Patch the two recomputation entry points (those this torch has) with ``patcher``."""
    function_cls = getattr(_ckpt, "CheckpointFunction", None)
    if function_cls is not None:
        current = function_cls.apply
        patcher.install(function_cls, "apply", lambda original: staticmethod(
            lambda function, *rest: current(_in_calls(function), *rest)))
    name = next((n for n in ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")
                 if hasattr(_ckpt, n)), None)
    if name is not None:
        patcher.install(_ckpt, name, lambda original: (
            lambda fn, *rest, **kwargs: original(_in_calls(fn), *rest, **kwargs)))


def _in_calls(function):
    """``function``, run inside the O2 calls in progress in this thread now (the checkpointed forward's)."""
    calls = [(copies, copies.in_call()) for copies in list(compute_copies.LIVE)]
    calls = [(copies, called) for copies, called in calls if called is not None]
    if not calls:
        return function

    def run(*args, **kwargs):
        frame = sys._getframe()  # (the re-entered calls' frame: one an interrupt cut off is dropped at the next call)
        with contextlib.ExitStack() as stack:
            with _past_selective_checkpoint():
                for copies, called in calls:
                    stack.enter_context(copies.reenter(called, frame))
            return function(*args, **kwargs)

    return run


def _past_selective_checkpoint():
    """Selective activation checkpointing (``context_fn=create_selective_checkpoint_contexts(...)``) replays the
    recomputation against the ops its forward ran, through a dispatch mode; the copies' casts ran before that
    forward (at the model's call), so the re-entry makes them with the dispatch modes set aside (autograd still
    records them: the grads reach the fp32 params)."""
    mode_stack, replay, disable = _dispatch_internals()
    if not any(isinstance(mode, replay) for mode in mode_stack()):
        return contextlib.nullcontext()
    return disable()


@functools.cache
def _dispatch_internals():
    purpose = "selective activation checkpointing under O2"
    return (compat.internal("torch.utils._python_dispatch._get_current_dispatch_mode_stack", purpose),
            compat.internal("torch.utils.checkpoint._CachedTorchDispatchMode", purpose),
            compat.internal("torch.utils._python_dispatch._disable_current_modes", purpose))
