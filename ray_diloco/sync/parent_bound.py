"""Hivemind's processes end with the SyncActor's process that forked them.

Hivemind runs the DHT node and each round's averager in child processes of the SyncActor's (forked: the DHT always,
the averager by Python's default start method on Linux), and the DHT's process starts the p2p daemon. Where the
SyncActor's process dies without shutting them down (a SIGKILL from its dying raylet, the OOM killer, `ray stop
--force`, a node's process group signalled), they were re-parented and ran on for ever: eight of them, and four p2p
daemons, after a local run's process group got SIGTERM (its raylet and GCS died with it, the actors after them).
Each such process now watches its parent from inside and, once it is gone, ends its own children (the p2p daemon)
and itself, removing first the socket files in /tmp that Hivemind's processes among them were listening on (a
process killed outright cannot remove its own).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time

from hivemind import DHT

POLL_SECONDS = 1.0  # how soon a process notices that its parent is gone
HIVEMIND_SOCKETS = "/hivemind-"  # in the paths of the p2p daemon's and its clients' socket files (/tmp/hivemind-…)


def exit_with_parent(poll_seconds: float = POLL_SECONDS) -> None:
    """In a child process, first thing: a daemon thread that kills this process's children and then this process
    once its parent (the process that started it) is gone. Polls rather than PR_SET_PDEATHSIG, which fires when the
    forking *thread* ends (a Ray actor forks from executor threads that come and go)."""
    parent = mp.parent_process()
    parent_pid = parent.pid if parent is not None else os.getppid()
    # Forked by the parent itself (hivemind's processes: fork), this process is re-parented once the parent dies;
    # started through a forkserver, its parent process is the server, so the parent's pid is watched instead.
    forked_by_parent = os.getppid() == parent_pid

    def gone() -> bool:
        return os.getppid() != parent_pid if forked_by_parent else not alive(parent_pid)

    def watch() -> None:
        while not gone():
            time.sleep(poll_seconds)
        files = set()
        for _ in range(3):  # again, for a child started as the first were killed (the p2p daemon at start-up)
            children = children_of(os.getpid())
            files |= socket_files([os.getpid(), *children], HIVEMIND_SOCKETS)
            for child in children:
                _kill(child)
        remove_files(files)
        _kill(os.getpid())

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` now (from /proc; none where there is no /proc)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:  # comm may hold spaces and ')'
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass  # gone meanwhile
    return found


def socket_files(pids: list[int], containing: str = "") -> set[str]:
    """The paths of the unix sockets that the processes `pids` hold now (a listening socket's file, and the
    connections it accepted), those whose path contains `containing`. From /proc: each fd's socket inode, and the
    path /proc/net/unix gives that inode (empty where there is no /proc)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[len("socket:["):-1])
    paths = set()
    with contextlib.suppress(OSError), open("/proc/net/unix") as table:
        next(table)  # "Num RefCount Protocol Flags Type St Inode Path"
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and containing in fields[7]:
                paths.add(fields[7])
    return paths


def remove_files(paths: set[str]) -> None:
    """Remove what is still there of `paths` (socket files of processes just killed)."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.remove(path)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child not yet reaped still has a /proc entry)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


class ParentBoundDHT(DHT):
    """Hivemind's DHT node, whose process (and p2p daemon) ends with the process that started it."""

    def run(self) -> None:
        exit_with_parent()
        super().run()
