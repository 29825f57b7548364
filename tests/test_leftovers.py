"""The leftover-process check of every module (tests/leftovers.py): a process the module started is found by its
mark even after it was re-parented, and a process forked from pytest by its start time; each is given the grace
period, then killed. What the module did not start is left alone."""

import multiprocessing
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


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while leftovers.command_line(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not leftovers.command_line(pid)


def test_a_process_left_behind_is_found_by_its_mark_or_start_and_killed():
    mark = leftovers.mark_for("leftover-self-test")
    unmarked = orphan({k: v for k, v in os.environ.items() if k != leftovers.MARK})  # started before: not ours
    since = leftovers.clock_ticks_now()
    marked = orphan({**os.environ, leftovers.MARK: mark})
    forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    forked.start()  # its environment is pytest's own at exec, without the mark
    try:
        started = time.monotonic()
        left = leftovers.left_behind(mark, since, grace_seconds=1.0)
        assert sorted(left) == sorted([marked, forked.pid]) and "sleep 60" in left[marked], left
        assert time.monotonic() - started >= 1.0  # it waited the grace period for them to exit
        assert gone(marked)
        forked.join(10)
        assert forked.exitcode == -9  # killed
        assert not gone(unmarked, timeout=0.0)
    finally:
        os.kill(unmarked, 9)


def test_a_process_that_exits_within_the_grace_period_is_not_reported():
    mark, since = leftovers.mark_for("leftover-self-test-exits"), leftovers.clock_ticks_now()
    subprocess.Popen(["sleep", "1"], env={**os.environ, leftovers.MARK: mark})
    assert leftovers.left_behind(mark, since, grace_seconds=10.0) == {}
