"""Hypothesis strategies for oracle programs, the CI/long profiles, and the two checks the tests make.

Profiles: the CI profile (default) runs ``EXAMPLES`` examples per property, derandomized (the same programs on
every run, no example database), so CI is reproducible. ``AMP_PATCH_ORACLE=long`` (for local runs:
``AMP_PATCH_ORACLE=long pytest tests/oracle``) runs 10x the examples, randomized: each long run tries new
programs; a failure prints the minimal program, which is enough to reproduce it as a ``Program(...)``.
"""
import os

from hypothesis import HealthCheck, Phase, assume, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from oracle_compare import TOLERANCE, diverged, first_mismatch, raised
from oracle_program import OP_ARGS, OPS, STEP_FEATURES, Op, Program, Step
from oracle_run import AmpRunner, Fp32Runner, NativeRunner, run_program
from oracle_text import PARAM_NAMES

LONG = os.environ.get("AMP_PATCH_ORACLE", "") == "long"
EXAMPLES = 40


def profile(examples=EXAMPLES):
    """Settings for one oracle property: ``examples`` in CI, 10x with ``AMP_PATCH_ORACLE=long``."""
    return settings(max_examples=examples * (10 if LONG else 1), derandomize=not LONG, database=None,
                    deadline=None, print_blob=False, suppress_health_check=list(HealthCheck),
                    phases=[p for p in Phase if p is not Phase.explain])


def _simple_ops(features, exclude=()):
    kinds = [k for k, (feature, _, _) in OPS.items() if (feature is None or feature in features) and k not in exclude]
    return st.sampled_from(kinds).flatmap(
        lambda kind: st.builds(Op, st.just(kind), st.integers(0, OP_ARGS.get(kind, 1) - 1)))


def ops(features, exclude=(), depth=0, focus=()):
    """One forward op; with "checkpoint" also a checkpointed segment of 1-3 ops, with "fp32_region" a region
    with casting off (both nest, two levels deep; each drawn 1 time in 8, 3 in 12 when named in ``focus``)."""
    simple = _simple_ops(features, exclude)
    if depth == 2:
        return simple
    inner = st.lists(ops(features, exclude, depth + 1, focus), min_size=1, max_size=3).map(tuple)
    options = {"simple": simple, "ckpt": st.builds(Op, st.just("ckpt"), st.integers(0, 1), inner),
               "fp32_region": st.builds(Op, st.just("fp32_region"), st.just(0), inner),
               "torch_off": st.builds(Op, st.just("torch_off"), st.just(0), inner)}
    compound = (("ckpt", "checkpoint"), ("fp32_region", "fp32_region"), ("torch_off", "torch_off"))
    drawn = ["simple"] * 6 + [k for k, f in compound if f in features for _ in range(3 if k in focus else 1)]
    return st.sampled_from(drawn).flatmap(options.__getitem__)


def steps(features, focus=()):
    """One step. Kinds are drawn with weights: the stale-state faults show between no-grad evaluations and
    .data writes, so those come three times as often as a deepcopy or a state_dict round trip."""
    seeds = st.integers(0, 20)
    args = {"train": st.tuples(st.integers(1, 3 if "multi_backward" in features else 1), seeds),
            "eval": st.tuples(seeds, st.integers(0, 2 if "grad_eval" in features else 1)),
            "data": st.tuples(st.integers(0, 5), st.integers(0, len(PARAM_NAMES) - 1), seeds),
            "freeze": st.tuples(st.integers(0, len(PARAM_NAMES) - 1), st.integers(0, 1)),
            "deepcopy": st.tuples(seeds),
            "state_dict": st.tuples(st.integers(0, 2), seeds)}
    weights = {"train": 2, "eval": 3, "data": 3, "deepcopy": 1, "state_dict": 1, "freeze": 1}
    kinds = [kind for kind in args if STEP_FEATURES[kind] is None or STEP_FEATURES[kind] in features
             or (kind == "eval" and "grad_eval" in features)]
    drawn = [kind for kind in kinds for _ in range(weights[kind] * (3 if kind in focus else 1))]
    return st.sampled_from(drawn).flatmap(lambda kind: st.builds(Step, st.just(kind), args[kind]))


LOSSES = ("mse", "l1", "smooth_l1", "cross_entropy", "sum")


def programs(features, exclude=(), optims=("sgd", "adam"), losses=LOSSES, focus=()):
    """Programs using the base ops and steps plus those of ``features`` (a subset of oracle_program.FEATURES),
    without the op kinds in ``exclude``, drawing the compound ops and step kinds named in ``focus`` 3x as often."""
    features = frozenset(features)
    return st.builds(
        Program,
        dtype=st.sampled_from(("bf16", "fp16")),
        ops=st.lists(ops(features, exclude, focus=focus), min_size=1, max_size=6).map(tuple),
        steps=st.lists(steps(features, focus), min_size=3, max_size=7).map(tuple),
        loss=st.sampled_from(losses),
        optim=st.sampled_from(optims),
        scale=st.sampled_from((1.0, 128.0)),
        seed=st.integers(0, 3),
    )


def check_matches_native(program, runner=None):
    """amp_patch (O1, ``torch_cpu`` unless ``runner`` says otherwise) must equal native autocast bitwise.

    Both raising at the same step agree; a program where both raise is then rejected as uninteresting (only
    inside a hypothesis test)."""
    runner = runner or AmpRunner("O1", "torch_cpu")
    native = run(program, NativeRunner())
    got = run(program, runner)
    diff = first_mismatch(native, got)
    if diff:
        raise AssertionError(f"{runner.name} differs from native torch.autocast:\n    {diff}\nprogram:{program!r}")
    return native


def check_close_to_fp32(program, runner):
    """``runner`` must stay within ``TOLERANCE`` of the fp32 run, or within ``SLACK`` times native autocast's
    drift from it (programs whose fp32 run raises or diverges are skipped)."""
    want = run(program, Fp32Runner())
    if raised(want) or diverged(want):
        return None
    got = run(program, runner)
    diff = first_mismatch(want, got, TOLERANCE[program.dtype], run(program, NativeRunner()))
    if diff:
        raise AssertionError(f"{runner.name} is not within {TOLERANCE[program.dtype]} of fp32:\n    {diff}\n"
                             f"program:{program!r}")
    return want


def run(program, runner):
    trace = run_program(program, runner)
    if currently_in_test_context():
        note(f"{runner.name}: {len(trace)} entries" + (f", ended by {trace[-1]}" if raised(trace) else ""))
    return trace


def assume_ran(trace):
    """Inside a hypothesis test: drop a program that raised everywhere (or whose fp32 run raised)."""
    assume(trace is not None and not raised(trace))
