"""Storage calls with a time bound (`ray_diloco.sync.bounded`)."""

import threading
import time

import pytest

from ray_diloco.sync.bounded import BoundedCalls


def test_a_hung_call_is_given_up_after_its_bound_and_blocks_only_its_own_kind():
    calls, release = BoundedCalls(), threading.Event()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^listing: no answer from the run's storage within 0.2 s"):
        calls.call("listing", release.wait, 0.2)
    assert 0.2 <= time.monotonic() - started < 1.0
    with pytest.raises(TimeoutError, match="previous call has not returned"):  # refused at once, no new thread
        calls.call("listing", lambda: "never run", 5.0)
    assert calls.call("record", lambda: 42, 1.0) == 42  # another kind goes on
    release.set()
    time.sleep(0.1)
    assert calls.call("listing", lambda: "again", 1.0) == "again"  # the hung one returned: calls go on


def test_a_calls_own_errors_reach_the_caller():
    calls = BoundedCalls()

    def fail():
        raise FileNotFoundError("no such bucket")

    with pytest.raises(FileNotFoundError, match="no such bucket"):
        calls.call("listing", fail, 1.0)

    def own_timeout():
        raise TimeoutError("the endpoint said so")

    with pytest.raises(TimeoutError, match="the endpoint said so"):
        calls.call("listing", own_timeout, 1.0)
