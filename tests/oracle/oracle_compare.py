"""Compare two oracle traces: bitwise (same policy) or within a tolerance of fp32 (a different policy).

Tolerances against fp32 (``TOLERANCE``): for each recorded tensor,
``max|got - fp32| <= max(tol * max(1, max|fp32|), SLACK * max|native - fp32|)`` with ``tol`` 0.1 for bfloat16 and
0.02 for float16 (about 25 and 20 units in the last place of the half dtype: a program runs up to eight half ops
and a few optimizer steps, each rounding to the half dtype), ``SLACK`` 4 and ``native`` the same program under
native autocast: where a program amplifies rounding (a LayerNorm of nearly equal values, training that
diverges), native autocast drifts from fp32 too, and a policy may drift 4x as far. A stale, shared or lost
weight is off by O(1) where native autocast is not. Programs whose fp32 run diverges (a value beyond 1e3 or not
finite) are not compared. A gradient that is ``None`` counts as zeros there (O2 may
keep a zero grad where fp32 has none). Bitwise means the same
dtype, shape and bits (NaNs included), and ``None`` only where the other is ``None``.
Exceptions: both runs must raise at the same step (messages may differ), or neither.
"""
import torch
from oracle_run import Raised

TOLERANCE = {"bf16": 0.1, "fp16": 0.02}
SLACK = 4.0
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    return t.contiguous().view(_INT_VIEW[t.element_size()]) if t.is_floating_point() else t


def _bitwise_diff(want, got):
    if want is None or got is None:
        return None if want is None and got is None else f"{_show(want)} vs {_show(got)}"
    if want.dtype != got.dtype or want.shape != got.shape:
        return f"{want.dtype}{tuple(want.shape)} vs {got.dtype}{tuple(got.shape)}"
    if torch.equal(_bits(want), _bits(got)):
        return None
    err = (want.double() - got.double()).abs().max().item()
    return f"values differ (max |diff| {err:.3g}): {_show(want)} vs {_show(got)}"


def _as_pair(want, got):
    want = torch.zeros_like(got) if want is None and got is not None else want
    got = torch.zeros_like(want) if got is None and want is not None else got
    return (None, None) if want is None else (want.double(), got.double())


def _error(want, got):
    """max |want - got|, or None when it cannot be measured (shapes differ, not finite)."""
    want, got = _as_pair(want, got)
    if want is None:
        return 0.0
    if want.shape != got.shape or not (torch.isfinite(want).all() and torch.isfinite(got).all()):
        return None
    return (want - got).abs().max().item()


def _close_diff(want, got, tol, drift):
    err = _error(want, got)
    pair = _as_pair(want, got)
    if err is None:
        same = pair[0] is not None and pair[0].shape == pair[1].shape and torch.equal(pair[0].nan_to_num(),
                                                                                         pair[1].nan_to_num())
        return None if same else f"shape or non-finite values differ: {_show(want)} vs {_show(got)}"
    bound = max(tol * max(1.0, pair[0].abs().max().item() if pair[0] is not None else 0.0), SLACK * (drift or 0.0))
    return None if err <= bound else f"max |diff| {err:.3g} > {bound:.3g}: {_show(want)} vs {_show(got)}"


def _show(value):
    if value is None:
        return "None"
    if isinstance(value, Raised):
        return f"raised {value.type}: {value.message}"
    flat = value.detach().flatten()[:6].tolist()
    return f"{value.dtype} {[round(v, 5) if isinstance(v, float) else v for v in flat]}"


def first_mismatch(want, got, tol=None, drifted=None):
    """The first difference between two traces as text (None when they agree). ``tol=None``: bitwise; else within
    ``tol`` or ``SLACK`` times the drift of the ``drifted`` trace (native autocast) from ``want`` (fp32)."""
    drift = _drifts(want, drifted or [])
    for i, ((label, w), (label2, g)) in enumerate(zip(want, got)):
        if isinstance(w, Raised) or isinstance(g, Raised):
            if isinstance(w, Raised) and isinstance(g, Raised) and label == label2:
                return None
            return f"{label}: {_show(w)}\n    vs {label2}: {_show(g)}"
        if label != label2:
            return f"entry {i}: {label} vs {label2}"
        diff = _bitwise_diff(w, g) if tol is None else _close_diff(w, g, tol, drift.get(label))
        if diff:
            return f"{label}: {diff}"
    if len(want) != len(got):
        return f"one run recorded {len(want)} entries, the other {len(got)}"
    return None


def _drifts(want, drifted):
    """label -> max |drifted - want| for the entries both traces recorded as tensors."""
    ref = {label: value for label, value in want if not isinstance(value, Raised)}
    return {label: _error(ref[label], value) for label, value in drifted
            if label in ref and not isinstance(value, Raised)}


def diverged(trace, limit=1e3):
    """Whether a trace holds a non-finite value or one beyond ``limit`` (training that diverged: no tolerance
    against it means anything)."""
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(v.abs().le(limit).all())
               for _, v in trace)


def raised(trace):
    return bool(trace) and isinstance(trace[-1][1], Raised)
