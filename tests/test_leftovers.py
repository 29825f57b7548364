"""The leftover-process check of every module (tests/leftovers.py) finds a process by its mark even after the
process was re-parented, gives it the grace period, and kills it."""

import os
import subprocess
import sys
import time

import leftovers


def orphan(env) -> int:
    """A `sleep` whose parent exits at once: re-parented as an orphaned Ray worker is (to pid 1 or a subreaper)."""
    code = "import subprocess as s; print(s.Popen(['sleep', '60'], stdout=s.DEVNULL, stderr=s.DEVNULL).pid)"
    spawner = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return int(spawner.stdout)


def test_a_process_left_behind_is_found_by_its_mark_and_killed():
    mark = leftovers.mark_for("leftover-self-test")
    pid = orphan({**os.environ, leftovers.MARK: mark})
    unmarked = orphan({k: v for k, v in os.environ.items() if k != leftovers.MARK})
    try:
        started = time.monotonic()
        left = leftovers.left_behind(mark, grace_seconds=1.0)
        assert list(left) == [pid] and "sleep 60" in left[pid]
        assert time.monotonic() - started >= 1.0  # it waited the grace period for the process to exit
        deadline = time.monotonic() + 10
        while pid in leftovers.marked(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid not in leftovers.marked(mark)  # killed
    finally:
        os.kill(unmarked, 9)


def test_a_process_that_exits_within_the_grace_period_is_not_reported():
    mark = leftovers.mark_for("leftover-self-test-exits")
    subprocess.Popen(["sleep", "1"], env={**os.environ, leftovers.MARK: mark})
    assert leftovers.left_behind(mark, grace_seconds=10.0) == {}
