"""Processes a test module started and left running, found by a mark in their environment.

A process a test leaves behind outlives the test's own process tree: an orphaned `ray::TrainController` (parent
pid 1) kept running through a local CI run after its raylet was gone, and two timing tests failed later on the
loaded cores. Its parent was gone, so no walk of the pytest process's descendants finds such a process. The
environment does: every process a module starts — a Ray cluster, its workers, a `ray start` head in a network
namespace, a driver, Hivemind's daemon — inherits the pytest process's environment, and with it a mark naming
the module (set before the module's first test). After the module, any live process still carrying the mark
was left by it.
"""

import os
import signal
import time

MARK = "RAY_DILOCO_TEST_MODULE"


def mark_for(module_name: str) -> str:
    return f"{os.getpid()}:{module_name}"


def marked(mark: str) -> dict[int, str]:
    """Live processes (zombies aside) whose environment carries `MARK=mark`, with their command lines; the
    pytest process itself left out. Empty where there is no /proc."""
    wanted = f"{MARK}={mark}".encode()
    found = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as file:
                if wanted not in file.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if command:  # a zombie has no command line: it is dead, only not reaped yet
            found[int(entry)] = command[:120]
    return found


def left_behind(mark: str, grace_seconds: float) -> dict[int, str]:
    """The marked processes still alive after `grace_seconds` (processes of a cluster just shut down take a few
    seconds to exit), each then killed so that it cannot load the next module's tests."""
    deadline = time.monotonic() + grace_seconds
    while (found := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return found
