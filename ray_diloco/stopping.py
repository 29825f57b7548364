"""Stopping a run cleanly: `ray job stop` (and the dashboard's stop button) send the driver SIGTERM, Ctrl-C
sends SIGINT. The first signal asks every region's SyncActor to end its region after the round in progress,
whose checkpoint its workers then write: the run stops at an outer-step boundary, writes its summary with
`stopped: true`, and continues from there when started again under its name. A second signal, or no
boundary within `run.stop_timeout_seconds`, interrupts the driver at once.
"""

from __future__ import annotations

import _thread
import logging
import signal
import threading
from typing import Any

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """A context manager around a run's training: installs the handlers (main thread only: Python allows no
    other) and forwards the request to the SyncActors from a thread (no Ray calls inside a signal handler)."""

    def __init__(self, sync_actors: list[Any], timeout: float):
        self.sync_actors, self.timeout = [a for a in sync_actors if a is not None], timeout
        self.requested, self._finished = threading.Event(), threading.Event()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "GracefulStop":
        if self.sync_actors and threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
            threading.Thread(target=self._forward, name="graceful-stop", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._finished.set()
        self.requested.set()  # releases the forwarding thread
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.requested.is_set():  # a second signal: stop now
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name} received twice")
        print(f"[driver] {signal.Signals(signum).name}: stopping at the end of the current outer step, with a "
              f"checkpoint (waiting up to {self.timeout:.0f} s; signal again to stop at once)", flush=True)
        self.requested.set()

    def _forward(self) -> None:
        self.requested.wait()
        if self._finished.is_set():
            return
        for actor in self.sync_actors:
            actor.request_stop.remote()
        if not self._finished.wait(self.timeout):
            logger.error("the regions did not reach an outer-step boundary within %.0f s: stopping now",
                         self.timeout)
            _thread.interrupt_main()
