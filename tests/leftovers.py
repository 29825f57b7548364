"""Processes a test module started and left running.

A process a test leaves behind may outlive the test's own process tree: an orphaned `ray::TrainController` (parent
pid 1) kept running through a local CI run after its raylet was gone, and two timing tests failed later on the
loaded cores. Its parent was gone, so no walk of the pytest process's descendants finds such a process. Its
environment does: every process a module starts with exec — a Ray cluster and its workers, a `ray start` head, a
driver, Hivemind's daemon — inherits the pytest process's environment, and with it a mark naming the module (set
before the module's first test). A process forked from pytest without exec (multiprocessing's "fork": Hivemind's
DHT) keeps the environment pytest was started with, without the mark; while it is still pytest's child, it is found
by its start time instead. After the module, a live process found either way was left by it.
"""

import os
import signal
import time

MARK = "RAY_DILOCO_TEST_MODULE"


def mark_for(module_name: str) -> str:
    return f"{os.getpid()}:{module_name}"


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks since boot) of every process, from /proc (no psutil in the
    dependencies). Empty where there is no /proc."""
    table = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    # "pid (comm) state ppid ... starttime ...": comm may hold spaces and parentheses; split after the
                    # last ')'. starttime is the 22nd field, the 20th after comm.
                    fields = stat.read().rsplit(")", 1)[1].split()
                table[int(entry)] = (int(fields[1]), int(fields[19]))
            except (OSError, IndexError, ValueError):
                pass  # gone meanwhile
    return table


def descendants(pid: int, table: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """Every process below `pid` now (children, their children, …)."""
    children: dict[int, list[int]] = {}
    for child, (parent, _) in (process_table() if table is None else table).items():
        children.setdefault(parent, []).append(child)
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def clock_ticks_now() -> int:
    """Now, in the clock ticks since boot that /proc's start times count."""
    with open("/proc/uptime") as uptime:
        return int(float(uptime.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def command_line(pid: int) -> str:
    """The command line ("" for a zombie: dead, only not reaped yet; or for a process gone meanwhile)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return ""


def carries(pid: int, variable: bytes) -> bool:
    """Whether the process's environment (as it was exec'd) holds `variable` (b"NAME=value")."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            return variable in file.read().split(b"\0")
    except OSError:  # gone meanwhile, or not ours to read
        return False


def started_by(mark: str, since_ticks: int) -> dict[int, str]:
    """Live processes (zombies aside) that carry `MARK=mark` in their environment, or are below the pytest process
    and started at or after `since_ticks`, with their command lines; the pytest process itself left out."""
    table, wanted = process_table(), f"{MARK}={mark}".encode()
    ours = set(descendants(os.getpid(), table))
    found = {}
    for pid, (_, started) in table.items():
        if pid != os.getpid() and ((pid in ours and started >= since_ticks) or carries(pid, wanted)):
            if command := command_line(pid):
                found[pid] = command
    return found


def left_behind(mark: str, since_ticks: int, grace_seconds: float) -> dict[int, str]:
    """The processes `started_by` the module still alive after `grace_seconds` (processes of a cluster just shut
    down take a few seconds to exit), each then killed so that it cannot load the next module's tests."""
    deadline = time.monotonic() + grace_seconds
    while (found := started_by(mark, since_ticks)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return found
