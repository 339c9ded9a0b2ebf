"""Apex's own tests for the modules amp_patch mirrors (``tests/L0`` and ``tests/distributed/synced_batchnorm`` of
NVIDIA/apex e13873de, named by ``AMP_PATCH_APEX_SRC``), run on CPU against the mirror by :mod:`apex_l0`.

Every test of a file passes, is skipped by Apex's own decorators (multi-GPU, features Apex disabled), or is
listed in ``apex_l0`` with its reason (ported away: it cannot mean on CPU what it means on CUDA; known: it fails
for a reason that is not the mirror's). CI profile by default (sizes shrunk by ``apex_l0.SHRINK``);
``AMP_PATCH_APEX_L0=long`` runs Apex's sizes. Skipped without an Apex checkout.
"""
import fnmatch

import apex_l0
import pytest

pytestmark = pytest.mark.skipif(apex_l0.tests_root() is None,
                                reason=f"no Apex checkout: set {apex_l0.ENV} to NVIDIA/apex at e13873de")
ENTRIES = apex_l0.selected(apex_l0.profile())


@pytest.fixture(scope="module")
def results():
    return apex_l0.run_files(ENTRIES)


@pytest.mark.parametrize("entry", ENTRIES, ids=apex_l0.file_id)
def test_apex_file_passes_on_cpu_against_the_mirror(results, entry):
    outcomes = results[apex_l0.file_id(entry)]
    failed = {key: message[-1200:] for key, (status, message, *_) in outcomes.items() if status == "fail"}
    assert outcomes and not failed, failed
    print(apex_l0.file_id(entry), apex_l0.counts(outcomes))


def test_every_listed_exception_is_still_met(results):
    """A known failure that now passes, or a ported-away pattern that matches no test, is a stale entry."""
    stale = [(name, key) for name in results for key in apex_l0.known_failures(name, apex_l0.profile())
             if results[name].get(key, [None])[0] != "known"]
    seen = {key: status for outcomes in results.values() for key, (status, *_) in outcomes.items()}
    ran = {entry[1] for entry in ENTRIES}
    stale += [pattern for pattern in apex_l0.PORTED_AWAY if pattern.split("::")[0] in ran
              and not any(status == "ported" and fnmatch.fnmatchcase(key, _as_id(pattern))
                          for key, status in seen.items())]
    assert not stale, stale


def _as_id(pattern):
    stem, test = pattern.split("::", 1)
    return f"{stem}::{stem}.{test}"
