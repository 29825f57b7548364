"""Calls to the run's storage with a time bound.

A SyncActor reads and writes the run's bucket from inside its waits (peer files and stored records while it polls
the other regions, states while it adopts one) and after its rounds (checkpoints, its final state). A bucket that
hangs (a network partition, a throttled endpoint) must cost that call, never the round or the group: each call
runs in a thread of its own and is given up after its bound. Python cannot stop a thread, so a call given up goes
on in the background; until it returns, a new call of the same kind is refused at once (TimeoutError), so a hung
bucket holds one thread per kind of call, not one per poll.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

LISTING_SECONDS = 30.0  # listing and reading the small files of the run's storage (peer files, records)


class BoundedCalls:
    """`call(kind, fn, seconds)`: fn's result, or TimeoutError after `seconds` (see the module docstring)."""

    def __init__(self) -> None:
        self._running: dict[str, Future] = {}
        self._lock = threading.Lock()

    def call(self, kind: str, fn: Callable[[], T], seconds: float) -> T:
        with self._lock:
            previous = self._running.get(kind)
            if previous is not None and not previous.done():
                raise TimeoutError(f"{kind}: the previous call has not returned yet (storage hung?)")
            future: Future = Future()
            self._running[kind] = future
        threading.Thread(target=_run, args=(future, fn), name=f"storage-{kind}", daemon=True).start()
        try:
            return future.result(timeout=seconds)
        except TimeoutError:
            if future.done():  # fn's own TimeoutError
                raise
            raise TimeoutError(f"{kind}: no answer from the run's storage within {seconds:g} s") from None


def _run(future: Future, fn: Callable[[], object]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as error:  # handed to the caller by future.result
        future.set_exception(error)
