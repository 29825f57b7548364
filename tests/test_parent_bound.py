"""Hivemind's processes end with the process that forked them (ray_diloco/sync/parent_bound.py): a SyncActor's
process killed outright (a dying raylet's SIGKILL) left its DHT node, its p2p daemon and its round's averager
running for ever, and their socket files stayed in /tmp. Here the forking process is a Python process of the
test's own, SIGKILLed. Last, a round's averager that does not answer its shutdown leaves its stacks before it is
terminated."""

import asyncio
import os
import select
import signal
import subprocess
import sys
import textwrap

import torch

from conftest import assert_gone
from leftovers import descendants

from ray_diloco.sync.parent_bound import HIVEMIND_SOCKETS, socket_files


def killed_parent_takes(code: str, seconds: float) -> tuple[list[int], set[str]]:
    """Runs `code` in a Python process of its own (it prints one line: the pids of the processes it forked, then
    waits), SIGKILLs that process, asserts that the processes below it just before are gone `seconds` later, and
    so are the Hivemind socket files they held; returns both. Whatever is left is killed."""
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code) + "\nimport time; time.sleep(300)"],
                               stdout=subprocess.PIPE, text=True)
    below = []
    try:
        ready, _, _ = select.select([process.stdout], [], [], 120)
        assert ready, "the forking process printed nothing within 120 s"
        forked = [int(pid) for pid in process.stdout.readline().split()]
        below = descendants(process.pid)
        assert set(forked) <= set(below), (forked, below)
        files = socket_files(below, HIVEMIND_SOCKETS)
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert_gone(below, timeout=seconds)
        assert not [path for path in files if os.path.exists(path)]
        return below, files
    finally:
        for pid in [process.pid, *below]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_a_region_averagers_processes_end_with_the_process_that_holds_it():
    """The DHT node, its p2p daemon, and the averager prepared for the next round after a round (one region
    expecting two: the round ends alone, after matchmaking)."""
    below, files = killed_parent_takes("""
        import torch
        from ray_diloco.sync.averaging import RegionAverager
        from ray_diloco.sync.parent_bound import children_of
        averager = RegionAverager(run_id="bound", region="a", expected_regions=2, matchmaking_seconds=1.0,
                                  averaging_timeout=3.0)
        averager.average({"x": torch.randn(8)}, 1.0, 0, expected_regions=2)
        averager._preparing.join(60)
        print(*children_of(__import__("os").getpid()), flush=True)
    """, seconds=15)
    assert len(below) >= 3, f"expected the DHT, its p2p daemon and a prepared averager: {below}"
    # the daemon's, and the averager's client's (its stream handlers listen on a socket of its own; the DHT's unary
    # handlers go through the daemon's)
    assert sum("p2pd" in path for path in files) == 1 and sum("p2pclient" in path for path in files) >= 1, files


def test_a_forked_process_that_watches_its_parent_ends_with_it_and_takes_its_children():
    below, _ = killed_parent_takes("""
        import multiprocessing as mp, subprocess, time
        from ray_diloco.sync.parent_bound import exit_with_parent
        def run():
            exit_with_parent(poll_seconds=0.2)
            subprocess.Popen(["sleep", "300"])
            time.sleep(300)
        child = mp.get_context("fork").Process(target=run, daemon=True)
        child.start()
        time.sleep(1)
        print(child.pid, flush=True)
    """, seconds=10)
    assert len(below) == 2, below  # the child and its `sleep`


def test_an_averager_that_does_not_shut_down_leaves_its_stacks_before_it_is_terminated(monkeypatch, capfd):
    """A round's averager (a forked child) that does not answer its shutdown is terminated; first it writes every
    thread's stack to stderr (the SyncActor's log), so an all-reduce that stalled says where (CI saw two, with
    the child unresponsive: issue 22's note)."""
    import hivemind

    from ray_diloco.sync.hivemind_exact import ExactAverager

    async def never_ends(self, timeout):
        await asyncio.sleep(3600)

    monkeypatch.setattr(ExactAverager, "_shutdown", never_ends)  # the child inherits it (fork)
    dht = hivemind.DHT(start=True)
    try:
        averager = ExactAverager([torch.zeros(4)], dht, prefix="stacks", target_group_size=2, min_group_size=2,
                                 shutdown_timeout=1.0)
        averager.run_in_background(await_ready=True, timeout=30)
        averager.shutdown()
        assert not averager.is_alive()
    finally:
        dht.shutdown()
    err = capfd.readouterr().err
    assert "most recent call first" in err and "hivemind_exact.py" in err and "in run" in err, err[-2000:]
