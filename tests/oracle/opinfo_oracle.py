"""Run torch's OpInfo database (``op_db``) under two casting runners and compare every output, dtype and bits.

A *runner* is a zero-argument callable returning a context manager that turns casting on: native
``torch.autocast`` (:func:`native_autocast`), an ``amp_patch.autocast`` region with an op list
(:func:`amp_patch_region`), or anything else with that shape (two amp_patch engines compared with each other).
:func:`compare_runners` runs each op's fp32 samples under both and returns, per op, what differs.

How an op is called: ``op_db`` holds the function objects captured when it was imported, which no patch
installed later can reach. Where ``torch.<name>`` (or ``torch.Tensor.<name>``) is that object, the op is looked
up by name inside the region, as user code does; an op whose ``op`` is a lambda (most methods, the dropouts, ...)
already looks its torch function up when called. Every run gets its own clone of each sample and the same RNG
seed, so in-place and random ops see the same inputs and draw the same numbers.

Compared: every output (tensors inside tuples, lists, dicts and ``torch.return_types``): type, dtype, shape and
bits (NaNs included, via an integer view); non-tensor outputs with ``==``. An op that raises must raise the same
exception type under the other runner. Skipped: ops that return uninitialized memory (:data:`UNINITIALIZED`).
"""
import dataclasses
import functools
import warnings

import torch
from torch.utils import _pytree as pytree

import amp_patch

# Ops whose outputs hold uninitialized memory (two runs differ with no casting at all).
UNINITIALIZED = ("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided")
# Ops whose fp32 results vary from call to call with no casting at all (same inputs, same process): compared in
# dtype, shape and values within 1e-4 (relative) instead of bits.
NONDETERMINISTIC = {
    "linalg.lstsq": "LAPACK's gelsy driver on 3x3 inputs differs in the last bits between identical fp32 calls",
    "linalg.lstsq.grad_oriented": "the same linalg.lstsq (gelsy driver)",
}
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def native_autocast(dtype=torch.bfloat16, device_type="cpu"):
    return lambda: torch.autocast(device_type, dtype=dtype)


def amp_patch_region(op_lists="torch_cpu", dtype=torch.bfloat16):
    return lambda: amp_patch.autocast(op_lists=op_lists, half_dtype=dtype)


@functools.lru_cache(maxsize=1)
def op_db():
    from torch.testing._internal.common_methods_invocations import op_db as db  # needs expecttest, hypothesis
    return tuple(db)


def op_key(op):
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def fp32_ops(keys=None):
    """The ops of ``op_db`` that take float32 on the CPU (all, or those whose :func:`op_key` is in ``keys``)."""
    ops = [op for op in op_db() if op.supports_dtype(torch.float32, "cpu") and op.name not in UNINITIALIZED]
    if keys is not None:
        missing = set(keys) - {op_key(op) for op in ops}
        if missing:
            raise KeyError(f"not fp32 ops of op_db: {sorted(missing)}")
        ops = [op for op in ops if op_key(op) in keys]
    return ops


def _by_path(path):
    obj = torch
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def caller(op):
    """A function calling ``op`` as user code would: looked up by name at call time where ``op.op`` is
    ``torch.<name>`` or ``torch.Tensor.<name>``, else ``op.op`` itself (a lambda that looks torch up when called)."""
    for path in (op.name, f"Tensor.{op.name}"):
        if _by_path(path) is op.op:
            return lambda *args, **kwargs: _by_path(path)(*args, **kwargs)
    return op.op


def samples(op, max_samples=None):
    """The op's fp32 CPU samples (the first ``max_samples``), drawn from a fixed seed. Drawn from the op's sample
    function itself: ``op.sample_inputs`` walks the whole call stack per op (``inspect.stack()``, seconds under
    pytest) and seeds every device through ``torch.manual_seed`` (which queues a stack trace per call)."""
    torch.default_generator.manual_seed(0)
    found = []
    try:
        for sample in op.sample_inputs_func(op, "cpu", torch.float32, False):
            found.append(sample)
            if max_samples is not None and len(found) >= max_samples:
                break
    except Exception:  # noqa: BLE001 - a sample function that fails on this build: the samples drawn so far
        pass
    return found


def _clone(value):
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, value)


@dataclasses.dataclass(frozen=True)
class Raised:
    kind: str
    message: str


def _call(call, sample, seed):
    """One sample's outputs, flattened to a list of leaves (or :class:`Raised`), on a clone of its inputs."""
    args = _clone((sample.input, *sample.args))
    kwargs = _clone(sample.kwargs)
    torch.default_generator.manual_seed(seed)
    try:
        out = call(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the other runner must raise the same kind
        return Raised(type(exc).__name__, str(exc).splitlines()[0][:120] if str(exc) else "")
    return pytree.tree_leaves(out)


def run_cases(runner, cases):
    """The outputs of every ``(call, sample, seed)`` case, all inside one ``runner()`` region."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecations and beta notices of the ops themselves
        with runner():
            return [_call(call, sample, seed) for call, sample, seed in cases]


def _show(t):
    return f"{t.dtype}{tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)[:60]


def _bits(t):
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    t = t.resolve_neg().resolve_conj()
    return t.contiguous().view(_INT_VIEW[t.element_size()]) if t.is_floating_point() else t


def leaf_difference(a, b, exact=True):
    """None when the two outputs agree (type, dtype, shape, bits; without ``exact``: values within 1e-4), else
    what differs."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{_show(a)} vs {_show(b)}"
        if a.dtype != b.dtype or a.shape != b.shape or a.layout != b.layout:
            return f"{_show(a)} vs {_show(b)}"
        if torch.equal(_bits(a), _bits(b)) or not exact and torch.allclose(
                a.detach().to_dense(), b.detach().to_dense(), rtol=1e-4, atol=1e-6, equal_nan=True):
            return None
        try:
            err = (a.detach().to_dense().double() - b.detach().to_dense().double()).abs().max().item()
        except (RuntimeError, TypeError):
            err = float("nan")
        return f"{_show(a)} values differ (max |diff| {err:.3g})"
    if type(a) is not type(b):
        return f"{_show(a)} vs {_show(b)}"
    try:
        same = a == b or (a != a and b != b)  # NaN scalars are equal here
    except Exception:  # noqa: BLE001 - objects without a usable ==: compare their text
        same = repr(a) == repr(b)
    return None if same else f"{_show(a)} vs {_show(b)}"


def sample_difference(a, b, exact=True):
    if isinstance(a, Raised) or isinstance(b, Raised):
        if isinstance(a, Raised) and isinstance(b, Raised) and a.kind == b.kind:
            return None
        return f"{a} vs {b}"
    if len(a) != len(b):
        return f"{len(a)} outputs vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        diff = leaf_difference(x, y, exact)
        if diff is not None:
            return f"output {i}: {diff}"
    return None


@dataclasses.dataclass
class OpReport:
    key: str
    samples: int
    differences: list  # (sample index, what differs)

    @property
    def agrees(self):
        return not self.differences


def _compare_chunk(ops, runner_a, runner_b, max_samples):
    prepared = [(op, caller(op), samples(op, max_samples)) for op in ops]
    cases = [(call, sample, i) for _, call, found in prepared for i, sample in enumerate(found)]
    outputs = iter(zip(run_cases(runner_a, cases), run_cases(runner_b, cases)))
    reports = []
    for op, _, found in prepared:
        exact = op_key(op) not in NONDETERMINISTIC
        pairs = [next(outputs) for _ in found]
        diffs = [(i, d) for i, (a, b) in enumerate(pairs) if (d := sample_difference(a, b, exact)) is not None]
        reports.append(OpReport(op_key(op), len(found), diffs))
    return reports


def compare_runners(runner_a, runner_b, ops=None, max_samples=None, chunk=64):
    """``{op key: OpReport}`` for every op (default: every fp32 op of ``op_db``) that has fp32 samples: each
    sample's outputs under ``runner_a`` against ``runner_b`` (the first ``max_samples`` samples of each op).
    Samples are drawn outside the regions; each runner's region is entered once per ``chunk`` ops."""
    ops = fp32_ops() if ops is None else list(ops)
    reports = {}
    for start in range(0, len(ops), chunk):
        for report in _compare_chunk(ops[start:start + chunk], runner_a, runner_b, max_samples):
            if report.samples:
                reports[report.key] = report
    return reports


def compare_op(op, runner_a, runner_b, max_samples=None):
    return _compare_chunk([op], runner_a, runner_b, max_samples)[0]


def compare_calls(runner_a, runner_b, cases):
    """``{name: None or what differs}`` for hand-made ``{name: (function, SampleInput)}`` cases (shapes op_db's
    samples do not reach), compared as op_db's samples are."""
    names = list(cases)
    seeded = [(cases[n][0], cases[n][1], i) for i, n in enumerate(names)]
    pairs = zip(run_cases(runner_a, seeded), run_cases(runner_b, seeded))
    return {n: sample_difference(a, b) for n, (a, b) in zip(names, pairs)}


def summary(reports):
    """A line with the counts (ops, samples) and ``{op key: differences}`` of the ops that differ."""
    differing = {k: r.differences for k, r in reports.items() if not r.agrees}
    samples_total = sum(r.samples for r in reports.values())
    samples_off = sum(len(r.differences) for r in reports.values())
    return (f"{len(reports) - len(differing)} of {len(reports)} ops agree "
            f"({samples_total - samples_off} of {samples_total} samples)", differing)
