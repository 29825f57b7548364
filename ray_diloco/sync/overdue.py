"""What a round that does not end becomes: the bound after which a region gives it up (`round_bound`), and whether a
blocking round past it finishes in the background, is abandoned, or fails the workers (`overdue_round`), and the
same for a round still in flight when the next one has waited that bound for it (`overdue_in_flight`). Pure
functions, part of the protocol's decisions (`ray_diloco.sync.policy` re-exports them): the SyncActor
(`scheduling.py`) and the protocol simulator (`tests/protocol_hangs.py`) both call them.
"""

from __future__ import annotations

# Rounds abandoned in a row (blocking, or in flight: `overdue_in_flight`) before the region gives up on them
# (fails its workers: Ray Train's failure handling, run.max_failures, takes over). A DHT that stays hung would
# otherwise keep the region training without ever averaging, each abandoned round leaving a thread blocked.
ABANDONED_ROUNDS_LIMIT = 3
FINISH_IN_BACKGROUND, ABANDON, FAIL = "finish in background", "abandon", "fail"


def round_bound(max_wait: float, averaging_timeout: float, download: float) -> float:
    """How long a round may take before it is given up: its other ranks arrive within seconds; the rendezvous and
    the settling after the last round each by max_wait plus one download (`download`: `download_seconds` of the
    state), with a load of up to two downloads begun just before; the all-reduce by the averaging timeout."""
    return 2 * max_wait + 2 * averaging_timeout + 6 * download + 60.0


def overdue_round(applied: bool, abandoned_in_a_row: int) -> tuple[str, int]:
    """What a blocking round still running at its `round_bound` becomes, and the count of rounds abandoned in a
    row after it. Its outer step applied (`applied`): the rest (publishing, settling) finishes in the
    background, the next round waits for it. Not applied: abandoned — its workers go on from θ_global at the
    step they were at, the region re-syncs at its next round (a hung DHT call so costs one round, never the
    group) — unless it is the ABANDONED_ROUNDS_LIMIT-th in a row, or any later one before a round ends: then the
    region's Hivemind node does not answer and the workers fail with the error (Ray Train's restarts, then the
    region leaves the run)."""
    if applied:
        return FINISH_IN_BACKGROUND, abandoned_in_a_row
    in_a_row = abandoned_in_a_row + 1
    return (FAIL if in_a_row >= ABANDONED_ROUNDS_LIMIT else ABANDON), in_a_row


def overdue_in_flight(abandoned_in_a_row: int) -> tuple[str, int]:
    """What a round still running when the next round has waited `round_bound` for it becomes (an overlapped
    round, or a blocking one left to finish in the background), and the count after it: abandoned, counted as an
    abandoned blocking round is, so the region fails its workers at the ABANDONED_ROUNDS_LIMIT-th in a row. Not
    counted, an overlapped region whose Hivemind node stayed hung trained on for ever without averaging, each
    abandoned round leaving a thread blocked (tests/test_hung_round.py)."""
    return overdue_round(False, abandoned_in_a_row)
