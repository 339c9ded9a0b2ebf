"""Checkpoint at step k, restore in a fresh process, and continue bit-identically to an uninterrupted run."""
import os
import subprocess
import sys

import pytest
import torch
from tests_support import TESTS

JOB = os.path.join(str(TESTS), "_resume_job.py")


LEVELS = ["O1", "O2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("resume") / "run")
    for stage in ("first", "second"):  # two processes: the resume starts from nothing but the checkpoint
        subprocess.run([sys.executable, JOB, stage, prefix, *LEVELS], check=True, timeout=180)
    return prefix


@pytest.mark.parametrize("level", LEVELS)
def test_resume_in_a_fresh_process_is_bit_identical(level, runs):
    path = f"{runs}-{level}"
    full, resumed = torch.load(path + ".full"), torch.load(path + ".resume")
    saved = torch.load(path + ".ckpt")
    # the checkpoint carries a non-default scale and a half-way growth tracker (step 1 overflowed)
    assert saved["amp"]["loss_scaler0"]["loss_scale"] == 2.0 ** 15
    assert saved["amp"]["loss_scaler0"]["unskipped"] == 1
    assert full["amp"] == resumed["amp"]
    for key in full["model"]:
        assert torch.equal(full["model"][key], resumed["model"][key]), key
    for a, b in zip(full["half"], resumed["half"]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for pid, state in full["opt"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, resumed["opt"]["state"][pid][name]), (pid, name)
