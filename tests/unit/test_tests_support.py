"""The test helpers themselves: a helper that cannot stop a hung launcher turns one hang into a hung CI."""
import os
import re
import sys
import time

import pytest
from tests_support import run_killing_group

# A launcher shaped like torchrun: its worker starts in a session of its own, inherits the output pipes and hangs.
_LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; print('worker up', flush=True); time.sleep(600)"],
                          start_new_session=True)
print("worker", worker.pid, flush=True)
time.sleep(600)
"""


def test_timeout_kills_workers_in_sessions_of_their_own(tmp_path):
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="timed out after 5s") as failed:
        run_killing_group([sys.executable, "-c", _LAUNCHER], tmp_path, timeout=5, scale=False)
    # killed at 5 s, its pipes drained within 30 s more: a helper that waited for the 600 s sleep fails here
    assert time.monotonic() - start < 300, "run_killing_group did not stop the launcher at its timeout"
    worker = int(re.search(r"^worker (\d+)$", str(failed.value), re.M).group(1))
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{worker}") or open(f"/proc/{worker}/stat").read().split(")")[1].split()[0] == "Z"


def test_time_limits_scale_with_the_measured_machine_speed(monkeypatch):
    from tests_support import TIME_SCALE_ENV, machine_slowdown, time_limit
    monkeypatch.delenv(TIME_SCALE_ENV, raising=False)
    assert machine_slowdown() >= 1.0 and time_limit(10) == 30 * machine_slowdown()
    monkeypatch.setenv(TIME_SCALE_ENV, "2")
    assert time_limit(10) == 20
