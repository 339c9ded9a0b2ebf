"""Gradient checkpointing recomputes under the casting state its forward had.

``torch.utils.checkpoint`` saves torch's own autocast state at the forward and restores it around the
recomputation (which runs during backward, maybe in another thread or with casting paused). amp_patch's state
is its own: this thread's ``disable_casts`` depth. While an engine is installed, the function handed to the
reentrant path (``CheckpointFunction.apply``) and to the non-reentrant one
(``_checkpoint_without_reentrant_generator``) is wrapped so that every call of it runs with the depth seen at
``checkpoint()``: the recomputed tensors get the forward's dtypes (no ``CheckpointError``, no silently different
grads). Both sites are looked up by name inside ``checkpoint``, so an early-bound ``checkpoint`` is reached too.
"""
import contextlib
import logging
import threading

import torch.utils.checkpoint as _ckpt

log = logging.getLogger("amp_patch")


def install(engine, patcher):
    """Patch the two recomputation entry points of ``torch.utils.checkpoint`` for ``engine`` (if this torch has
    them: other versions are logged and left as they are)."""
    function_cls = getattr(_ckpt, "CheckpointFunction", None)
    if function_cls is not None:
        bound_apply = function_cls.apply  # (O2's recompute_copies may have wrapped it: wrapped again)
        patcher.install(function_cls, "apply", lambda original: staticmethod(
            lambda function, *rest: bound_apply(_pinned(engine, function), *rest)))
    else:
        log.debug("torch.utils.checkpoint.CheckpointFunction.apply not found: reentrant recompute not pinned")
    # torch 2.15 calls ``_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, ...)`` itself and keeps the
    # older name as a shim over it; earlier releases have only the older name (same first argument)
    name = next((n for n in ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")
                 if hasattr(_ckpt, n)), None)
    if name is not None:
        patcher.install(_ckpt, name, lambda original: (
            lambda fn, *rest, **kwargs: original(_pinned(engine, fn), *rest, **kwargs)))
    else:
        log.debug("torch.utils.checkpoint._checkpoint_without_reentrant_generator not found: not pinned")


def _pinned(engine, function):
    """``function`` run with this thread's casting state as it is now (the checkpointed forward's).

    The backward may run after the engine's region or session ended (``with amp_patch.autocast(): out =
    model(x)``, then ``out.sum().backward()``, as with torch.autocast): then the recomputation runs under
    whatever engine is active now, or, with none, under a temporary region with the forward's op table.
    """
    depth = engine.disabled.get(threading.get_ident(), 0)
    fast = engine.fast is not None and engine.fast.here()  # the forward ran in a fast region: so does the recompute

    def run(*args, **kwargs):
        if engine.installed:
            with _depth(engine.disabled, depth), _cache_region(engine), _fast_region(engine, fast):
                return function(*args, **kwargs)
        activation = engine.activation
        live = activation.active_engine() if activation is not None else None
        if live is not None:
            with _depth(live.disabled, depth), _cache_region(live):
                return function(*args, **kwargs)
        if depth or activation is None:  # the forward ran with casting off: so does its recomputation
            return function(*args, **kwargs)
        with activation.reopened(engine):
            return function(*args, **kwargs)

    return run


@contextlib.contextmanager
def _cache_region(engine):
    """The recomputation is a region of its own for the cast cache, as torch recomputes under a fresh
    ``torch.autocast``: a weight used twice in the segment is cast once there (outside any forward, in the
    backward, nothing would be cached), and the casts are dropped when it returns. Inside a forward or region
    (the checkpointed forward itself) the cache is already in use: nothing to do."""
    if not engine.cache.outside(threading.get_ident()):
        yield
        return
    try:  # (entered inside the try: an interrupt in it leaves nothing the tolerant exit does not end)
        engine.enter_region()
        yield
    finally:
        engine.exit_region()


@contextlib.contextmanager
def _fast_region(engine, fast):
    """torch restores the forward's native autocast state around the recompute; the hybrid engine's switches
    follow it (a fast region for a forward that had one), so each op is cast by the same side as in the forward."""
    if not fast or engine.fast is None:
        yield
        return
    regions, ident = engine.fast, threading.get_ident()
    before = regions.depth.get(ident, 0)  # (open's first change is the depth: closed only if it began)
    try:
        regions.open()
        yield
    finally:
        if regions.depth.get(ident, 0) > before:
            regions.close()


@contextlib.contextmanager
def _depth(disabled, depth):
    ident = threading.get_ident()
    before = disabled.get(ident, 0)
    try:  # (set inside the try: an interrupt in it still puts the depth back)
        _set(disabled, ident, depth)
        yield
    finally:
        _set(disabled, ident, before)


def _set(disabled, ident, depth):
    disabled.set_depth(ident, depth)
