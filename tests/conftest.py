"""Shared fixtures. The autouse ``no_patch_leaks`` fixture fails any test that leaves a patch behind."""
import pytest
import torch
import torch.nn.functional as F

import amp_patch
from amp_patch import _state
from amp_patch.registry import REGISTRY
from tests_support import leaks_of

# Importing these patches torch attributes on first use (e.g. dynamo wraps torch.manual_seed); do it
# once up front so the snapshot below only sees amp_patch's own changes.
import torch._dynamo  # noqa: F401,E402

PATCHED_NAMESPACES = (torch, F, torch.Tensor, torch._C._nn, torch._C._linalg, torch._C._special, torch.linalg,
                      torch.special, torch.fft, torch._C.TensorBase)


def _snapshot():
    return {id(ns): (ns, dict(vars(ns))) for ns in PATCHED_NAMESPACES} | {id(torch._VF): (torch._VF, dict(vars(torch._VF)))}




@pytest.fixture(autouse=True)
def no_patch_leaks():
    """Snapshot vars() of every namespace amp_patch patches; fail the test if anything differs after it."""
    before = _snapshot()
    yield
    stray_region = _state.current() is None and _state.active_engine() is not None
    amp_patch.deinitialize()  # a session left open is the test's cleanup; what stays after it is a leak
    REGISTRY.clear()
    leaks = leaks_of(before)
    assert not stray_region, "an amp_patch.autocast() region was left open"
    assert not leaks, f"test leaked patches: {sorted(leaks)[:20]}"
