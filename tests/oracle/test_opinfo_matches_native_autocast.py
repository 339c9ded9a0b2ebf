"""``torch_cpu`` against native ``torch.autocast("cpu", torch.bfloat16)`` over torch's OpInfo database.

Every op of ``op_db`` with fp32 CPU samples runs each sample under native autocast and under
``amp_patch.autocast(op_lists="torch_cpu")``; every output must have native's dtype and bits (the harness is
``opinfo_oracle``). The ops where a Python entry point cannot reproduce native autocast are listed in
:data:`CANNOT_MATCH` and in docs/op_lists.md ("Where the torch lists cannot be bitwise native"), each with how it
differs: ``bits`` (every output has native's dtype, values differ) or ``dtype`` (some sample's dtype differs, or
one side raises).

The default suite runs the first sample of every op and every sample of the ops named in the list's composite
entries and in :data:`CANNOT_MATCH`; the whole database, every sample, is ``pytest -m stress`` (minutes).
"""
import pathlib
import re

import pytest
import torch

pytest.importorskip("expecttest")  # op_db imports common_utils, which needs it

import opinfo_oracle as oo  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "op_lists.md"

# op_db key -> how torch_cpu's result differs from native's (kept equal to the docs' table)
CANNOT_MATCH = {
    "cov": "bits",
    "corrcoef": "bits",
    "nn.functional.bilinear": "bits",
    "einsum": "dtype",
    "tensordot": "dtype",
    "linalg.matrix_power": "dtype",
    "linalg.pinv": "dtype",
    "linalg.pinv.hermitian": "dtype",
    "linalg.polar": "bits",  # in op_db from torch 2.15 (a C++ composite there)
}
# ops whose composites the list casts at the Python entry (every sample in the default suite)
COMPOSITES = {"linalg.multi_dot", "inner", "matmul", "linalg.vecdot", "nn.functional.linear"}


def _kind(differences):
    """``bits`` when every difference is in values only, else ``dtype``."""
    return "bits" if all("values differ" in what for _, what in differences) else "dtype"


def _observed(reports):
    return {key: _kind(r.differences) for key, r in reports.items() if not r.agrees}


def _unexpected(observed, *, exact, ran=None):
    """What disagrees with CANNOT_MATCH: an op not in it, or a ``dtype`` difference where it says ``bits``;
    with ``exact``, also an op in it that ran (``ran``: the op_db names this torch has) and now agrees (or differs
    less: the docs must say so)."""
    wrong = {k: v for k, v in observed.items() if CANNOT_MATCH.get(k) not in (v, "dtype")}
    if exact:
        wrong.update({k: f"{observed.get(k, 'agrees')}, listed as {v}" for k, v in CANNOT_MATCH.items()
                      if observed.get(k) != v and (ran is None or k in ran)})
    return wrong


def _run(max_samples, full_keys=()):
    """Every op's first ``max_samples`` samples, and every sample of the ``full_keys`` this torch's op_db has."""
    ours, native = oo.amp_patch_region("torch_cpu"), oo.native_autocast(torch.bfloat16)
    reports = oo.compare_runners(native, ours, max_samples=max_samples)
    present = {oo.op_key(op) for op in oo.fp32_ops()}
    reports.update(oo.compare_runners(native, ours, ops=oo.fp32_ops(set(full_keys) & present)))
    return reports


def test_every_op_first_sample_and_every_sample_of_the_composites():
    reports = _run(1, CANNOT_MATCH.keys() | COMPOSITES)
    assert len(reports) > 600
    assert _unexpected(_observed(reports), exact=True, ran=reports.keys()) == {}


@pytest.mark.stress
def test_every_op_every_sample():
    """By hand: ``pytest -m stress tests/oracle/test_opinfo_matches_native_autocast.py`` (about 90 s of CPU
    time; 7.5 minutes on the shared 2-core machine under load)."""
    reports = _run(None)
    assert _unexpected(_observed(reports), exact=True, ran=reports.keys()) == {}


def test_the_docs_list_every_op_that_cannot_match():
    """docs/op_lists.md's table names the same ops, with the same kind of difference."""
    section = DOCS.read_text().split("## Where the torch lists cannot be bitwise native", 1)[1].split("\n## ")[0]
    rows = dict(re.findall(r"^\| `([\w.]+)` \| (bits|dtype) \|", section, flags=re.M))
    assert rows == CANNOT_MATCH


def test_the_comparison_fails_where_the_policy_differs():
    """The harness can fail: the apex list runs mv in half, native CPU autocast leaves it fp32; and a list
    without the composite entries leaves multi_dot fp32 where native runs its mm in half."""
    native = oo.native_autocast(torch.bfloat16)
    apex = oo.compare_runners(native, oo.amp_patch_region("apex"), ops=oo.fp32_ops({"mv"}))
    assert "torch.float32" in apex["mv"].differences[0][1]
    no_composites = {"extends": "torch_cpu", "remove": {"torch.linalg": ["multi_dot"]}}
    bare = oo.compare_runners(native, oo.amp_patch_region(no_composites), ops=oo.fp32_ops({"linalg.multi_dot"}))
    assert "bfloat16" in bare["linalg.multi_dot"].differences[0][1]


def test_two_runs_with_no_casting_agree_bitwise():
    """The harness is deterministic (seeded, each run on its own clone): random and in-place ops included."""
    import contextlib

    keys = {"nn.functional.dropout", "bernoulli", "normal", "uniform", "resize_", "add", "linalg.svd"}
    reports = oo.compare_runners(contextlib.nullcontext, contextlib.nullcontext, ops=oo.fp32_ops(keys))
    assert set(reports) == keys and all(r.agrees for r in reports.values())


def _matmul_shaped_cases():
    """Calls of the composites with the shapes models use (op_db's samples are mostly tiny edge cases):
    name -> (function looked up at call time, sample, how it compares to native: agrees / bits / dtype)."""
    from torch.testing._internal.opinfo.core import SampleInput

    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return {
        "einsum-attention": (lambda *a: torch.einsum(*a), SampleInput("bhqd,bhkd->bhqk", args=(r(2, 2, 4, 8),
                                                                                             r(2, 2, 5, 8))),
                             "dtype"),
        "tensordot-dims1": (lambda *a, **k: torch.tensordot(*a, **k), SampleInput(r(4, 5, 6), args=(r(6, 3),),
                                                                                  kwargs={"dims": 1}), "dtype"),
        "chain_matmul": (lambda *a: torch.chain_matmul(*a), SampleInput(r(4, 5), args=(r(5, 6), r(6, 3))),
                         "agrees"),
        "multi_dot": (lambda a: torch.linalg.multi_dot(a), SampleInput([r(4, 5), r(5, 6), r(6, 3)]), "agrees"),
        "Tensor.cov": (lambda x: x.cov(), SampleInput(r(4, 16)), "bits"),
        "bilinear": (lambda *a: torch.nn.functional.bilinear(*a), SampleInput(r(8, 6), args=(r(8, 5), r(3, 6, 5))),
                     "bits"),
        "inner-2d": (lambda *a: torch.inner(*a), SampleInput(r(4, 8), args=(r(3, 8),)), "dtype"),
        "matrix_power-3": (lambda *a: torch.linalg.matrix_power(*a), SampleInput(r(4, 4), args=(3,)), "dtype"),
    }


def test_matmul_shaped_calls_beyond_op_db():
    cases = _matmul_shaped_cases()
    found = oo.compare_calls(oo.native_autocast(torch.bfloat16), oo.amp_patch_region("torch_cpu"),
                             {name: case[:2] for name, case in cases.items()})
    kinds = {name: "agrees" if diff is None else _kind([(0, diff)]) for name, diff in found.items()}
    assert kinds == {name: case[2] for name, case in cases.items()}
