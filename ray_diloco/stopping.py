"""Stopping a run cleanly: `ray job stop` (and the dashboard's stop button) send the driver SIGTERM, Ctrl-C
sends SIGINT. `RunStop` handles both for the whole life of the driver, in three phases:

- starting (config, Ray, Hivemind, data): a stop ends the driver at once, before any training, with one line
  (`RunStopped`, raised from the handler: no training thread exists yet), nothing to checkpoint;
- training: the first signal asks every region's SyncActor to end its region after the round in progress, whose
  checkpoint its workers then write; the run stops at an outer-step boundary, writes its summary with
  `stopped: true`, and continues from there when started again under its name. A second signal, or no boundary
  within `run.stop_timeout_seconds`, makes the driver abort the regions still training (`deadline_passed`).
  ddp and single runs have no outer-step boundary to stop at: their first signal aborts at once;
- finishing (final evaluation, export, summary): a signal is noted and the driver finishes what it writes, so
  the exported model and summary are never half-written.

The handler only records the request; the driver's main loop acts on it (no Ray calls inside a signal handler,
and no exception raised into code that is waiting on threads: that was how the stop timeout once failed to stop
a driver whose `ThreadPoolExecutor` waited for every `fit()` to return).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from ray_diloco.config_fields import require

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# After the stop timeout the driver still aborts the groups (lifecycle.ABORT_GRACE_SECONDS), releases its actors
# (RELEASE_SECONDS), evaluates, exports and writes its summary: how long Ray must wait beyond
# run.stop_timeout_seconds before it kills a stopped job (RAY_JOB_STOP_WAIT_TIME_S). The final evaluation runs
# on the driver's CPU: for the tiny and 150m presets well inside this; not for 1b (see README, "Stopping").
FINISHING_MARGIN_SECONDS = 120.0


def check_stop_timeout(cfg: Any) -> None:
    """run.stop_timeout_seconds must hold the rounds a stop may wait for (a one-line ConfigError naming the fields
    where it does not). With outer.overlap a stop first ends the round in flight, then runs the stop's own: two
    rounds. Blocking, with several regions in this driver, a request that comes while they average ends the round
    after (policy.stops_after_round): the all-reduce in progress, then one round."""
    outer, rounds = cfg.outer, 2 if cfg.outer.overlap else 1
    in_progress = not outer.overlap and len(cfg.local_regions()) > 1
    bound = rounds * (outer.max_wait_seconds + outer.averaging_timeout) + in_progress * outer.averaging_timeout
    what = ("two rounds' wait and all-reduce (2 x (outer.max_wait_seconds + outer.averaging_timeout)" if rounds == 2
            else "an all-reduce in progress, then one round's wait and all-reduce (outer.max_wait_seconds + "
            "2 x outer.averaging_timeout" if in_progress
            else "one round's wait and all-reduce ((outer.max_wait_seconds + outer.averaging_timeout)")
    require(cfg.run.mode != "diloco" or cfg.run.stop_timeout_seconds >= bound, "run.stop_timeout_seconds",
            f"{cfg.run.stop_timeout_seconds:g} s cannot hold {what} = {bound:g} s), before the rest of a "
            "window: raise it, or lower those two")


class RunStopped(BaseException):
    """The run was asked to stop before any region finished a round it could report (start-up, or every region
    aborted at the stop timeout). The message says what was stopped and what was last checkpointed. A
    BaseException, like KeyboardInterrupt: start-up code that catches Exception must not swallow it."""


class RunStop:
    """The driver's signal handling (main thread only: Python allows no other). Use as a context manager around
    the whole run; `reinstall()` after anything that sets its own handler (`ray.init` does). A driver run in
    another thread (tests/conftest.py's RunInThread) gets one never entered: no handlers, `abort()` its only stop."""

    def __init__(self, timeout: float = 0.0):
        self.timeout = timeout  # run.stop_timeout_seconds (set once the config is known)
        self.phase = "starting"
        self.requested = threading.Event()
        self.requested_at: float | None = None  # time.monotonic() of the first signal
        self.forced = False  # a second signal while training: stop now
        self._previous: dict[int, Any] = {}
        self._sync_actors: list[Any] = []
        self._lock = threading.Lock()

    def __enter__(self) -> "RunStop":
        self.reinstall()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def reinstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.phase == "finishing":
            print(f"[driver] {name}: training is over; finishing the evaluation, export and summary first",
                  flush=True)
            return
        if self.phase == "starting":
            self.requested_at = self.requested_at or time.monotonic()
            self.requested.set()
            raise RunStopped("stopped on request before training started: nothing was trained or checkpointed")
        if self.requested.is_set():
            if not self.forced:
                print(f"[driver] {name} again: aborting the regions still training now", flush=True)
                self.forced = True
            return
        self.requested_at = time.monotonic()
        self.requested.set()
        if not self._sync_actors:  # ddp, single: no outer-step boundary, nothing to checkpoint
            print(f"[driver] {name}: a ddp or single run has no outer step to stop at: stopping now", flush=True)
            self.forced = True
            return
        print(f"[driver] {name}: stopping at the end of the current outer step, with a checkpoint (waiting up "
              f"to {self.timeout:.0f} s; signal again to stop at once)", flush=True)
        threading.Thread(target=self._forward, name="run-stop-forward", daemon=True).start()

    def start_training(self, sync_actors: list[Any]) -> None:
        """Training begins: from now on a stop goes to these SyncActors (at once if one came before)."""
        self.raise_if_requested()
        with self._lock:
            self._sync_actors = [a for a in sync_actors if a is not None]
            self.phase = "training"

    def finish(self) -> None:
        """Training is over: signals no longer interrupt anything."""
        self.phase = "finishing"

    def abort(self, why: str) -> None:
        """Stop now, without a checkpoint: this driver may no longer write the run's files (its lease on a
        region was taken over), or a test ended before its run. Safe from any thread."""
        print(f"[driver] {why}: stopping now, without a checkpoint", flush=True)
        self.requested_at = self.requested_at or time.monotonic()
        self.forced = True
        self.requested.set()

    def raise_if_requested(self) -> None:
        """At a start-up step: a stop asked for so far ends the run here."""
        if self.phase == "starting" and self.requested.is_set():
            raise RunStopped("stopped on request before training started: nothing was trained or checkpointed")

    def deadline_passed(self) -> bool:
        """While training: whether the regions still training must be aborted (a second signal, or no outer-step
        boundary within the stop timeout)."""
        if self.requested_at is None:
            return False
        return self.forced or time.monotonic() - self.requested_at > self.timeout

    def _forward(self) -> None:
        with self._lock:
            actors = list(self._sync_actors)
        for actor in actors:
            try:
                actor.request_stop.remote()
            except Exception as error:  # a dead actor: its region is not training anyway
                logger.warning("could not forward the stop to a SyncActor: %s", error)
