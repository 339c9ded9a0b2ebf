"""Shared fixtures. The autouse ``no_patch_leaks`` fixture fails any test that leaves a patch behind."""
import signal

import pytest
import torch

# Importing these patches torch attributes on first use (e.g. dynamo wraps torch.manual_seed); do it
# once up front so the snapshot below only sees amp_patch's own changes.
import torch._dynamo  # noqa: F401,E402
import torch.nn.functional as F
from tests_support import leaks_of

import amp_patch
from amp_patch.patching import registry
from amp_patch.session import state as _state
from amp_patch.session.user_functions import REGISTRY


def _patched_namespaces():
    """Every target of every shipped op list, plus the namespaces user registrations and tests touch."""
    from amp_patch.patching.resolve import resolve_target

    found = {id(ns): ns for ns in (torch, F, torch.Tensor, torch._C.TensorBase, torch._VF, torch.optim.Optimizer,
                                                         torch.amp.autocast_mode.autocast)}
    for name in amp_patch.shipped_names():
        for entry in amp_patch.load_op_lists(name).entries:
            target = resolve_target(entry.target)
            found.setdefault(id(target), target)
    return tuple(found.values())


PATCHED_NAMESPACES = _patched_namespaces()


def _snapshot():
    return {id(ns): (ns, dict(vars(ns))) for ns in PATCHED_NAMESPACES}


@pytest.fixture(autouse=True, scope="session")
def sigint_raises_keyboard_interrupt():
    """The Ctrl-C tests need SIGINT to raise KeyboardInterrupt here and in the processes they start. A shell
    without job control starts a background command (`pytest &`, a CI step in the background) with SIGINT
    ignored, and Python then keeps it ignored (and so do the children): give SIGINT Python's handler back."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _native_autocast():
    """This thread's native CPU autocast switch, dtype and nesting count, read from torch's C++ state (the count by
    taking one and giving it back): a count left off by one keeps native's cast cache past a region's exit."""
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return torch._C.is_autocast_enabled("cpu"), torch._C.get_autocast_dtype("cpu"), nesting


@pytest.fixture(autouse=True)
def no_patch_leaks():
    """Snapshot vars() of every namespace amp_patch patches; fail the test if anything differs after it."""
    before, native = _snapshot(), _native_autocast()
    yield
    stray_region = _state.current() is None and _state.active_engine() is not None
    amp_patch.deinitialize()  # a session left open is the test's cleanup; what stays after it is a leak
    REGISTRY.clear()
    leaks = leaks_of(before)
    native_after = _native_autocast()
    if native_after != native:  # (put back, so that one leak does not fail every later test)
        torch._C.set_autocast_enabled("cpu", native[0])
        torch._C.set_autocast_dtype("cpu", native[1])
        for _ in range(native_after[2] - native[2]):
            torch.autocast_decrement_nesting()
        for _ in range(native[2] - native_after[2]):
            torch.autocast_increment_nesting()
    assert native_after == native, f"native autocast state left changed in the thread: {native} -> {native_after}"
    assert not stray_region, "an amp_patch.autocast() region was left open"
    assert not registry.installed(), f"patches still registered: {registry.installed()[:20]}"
    assert not leaks, f"test leaked patches: {sorted(leaks)[:20]}"
