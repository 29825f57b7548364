"""Hivemind's processes end with the process that forked them (ray_diloco/sync/parent_bound.py): a SyncActor's
process killed outright (a dying raylet's SIGKILL) left its DHT node, its p2p daemon and its round's averager
running for ever. Here the forking process is a Python process of the test's own, SIGKILLed."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from ray_diloco.sync.parent_bound import children_of


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not reaped
    except OSError:
        return False


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """Those of `pids` still alive after `seconds`."""
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pid for pid in pids if alive(pid)]


def forking_process(code: str) -> tuple[subprocess.Popen, int]:
    """A Python process that runs `code` (which prints the pid of the process it forked) and then waits."""
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code) + "\nimport time; time.sleep(300)"],
                               stdout=subprocess.PIPE, text=True)
    return process, int(process.stdout.readline())


def test_the_dht_process_and_its_p2p_daemon_end_with_the_process_that_started_them():
    process, dht_pid = forking_process("""
        from ray_diloco.sync.parent_bound import ParentBoundDHT
        dht = ParentBoundDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        print(dht.pid, flush=True)
    """)
    daemons = children_of(dht_pid)
    assert daemons, "the DHT's process started no p2p daemon"
    process.send_signal(signal.SIGKILL)
    process.wait()
    left = gone_within([dht_pid, *daemons], seconds=15)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after their parent was killed: {left}"


def test_a_forked_process_that_watches_its_parent_ends_with_it_and_takes_its_children():
    """The mechanism the round's averager (hivemind_exact.ExactAverager.run) uses too."""
    process, child_pid = forking_process("""
        import multiprocessing as mp, subprocess, time
        from ray_diloco.sync.parent_bound import exit_with_parent
        def run():
            exit_with_parent(poll_seconds=0.2)
            subprocess.Popen(["sleep", "300"])
            time.sleep(300)
        child = mp.get_context("fork").Process(target=run, daemon=True)
        child.start()
        print(child.pid, flush=True)
    """)
    deadline = time.monotonic() + 10
    while not children_of(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    grandchildren = children_of(child_pid)
    assert grandchildren
    process.send_signal(signal.SIGKILL)
    process.wait()
    left = gone_within([child_pid, *grandchildren], seconds=10)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after their parent was killed: {left}"
