"""A round that hangs (a DHT call that never returns) costs that round, never the region's worker group.

Before: the last rank to hand in its shards ran the round with no bound and the others waited twice the actor's
bound, then raised to their workers: a Ray Train failure, and repeated slow rounds used up `max_failures` and
the region left the run. Now the blocking round is abandoned after the bound (`SyncActor._await_bound`): the workers
get θ_global back at the outer step they were at, train the next window from it, and the region catches up with
the others at its next round (re-sync). Real SyncActors, Hivemind and state sharing in this process (no Ray).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from ray_diloco.sharding import from_wire
from ray_diloco.sync.actor import SyncActorImpl
from ray_diloco.sync.outer import state_digest
from test_sync_actor import MM, config, trained

BOUND = 4.0  # the actor's bound cut to seconds (it is minutes: max_wait, the averaging timeout, downloads)


@contextlib.contextmanager
def hung_region(tmp_path, name: str, hang_seconds: float, outer_steps: int = 3, overlap: bool = False):
    """Regions r0 and r1 (real SyncActors and Hivemind in this process) where r0's DHT reads do not answer until
    the test sets `released` (or `hang_seconds` pass: bounded, so a test also ends before the fix), and r0's bound is
    BOUND. Yields (r0, r1, released, r0's own read of the records)."""
    cfg = config(tmp_path, name, [1, 1], matchmaking_seconds=MM, outer_steps=outer_steps)
    cfg["outer"].update(max_wait_seconds=3.0, overlap=overlap)
    a = SyncActorImpl(cfg, "r0")
    b = None
    released = threading.Event()
    try:
        b = SyncActorImpl(cfg, "r1", initial_peers=a.multiaddrs())
        a._await_bound = lambda: BOUND  # a test seam: the formula's constant part alone is a minute
        read_records = a.sharer.records
        a.sharer.records = lambda *args, **kwargs: released.wait(hang_seconds) and read_records(*args, **kwargs)
        yield a, b, released, read_records
    finally:
        released.set()
        for actor in (b, a):
            if actor is not None:
                actor.shutdown()


START = {"batches": 0, "epoch": 0, "epoch_batches": 0, "windows": 0, "fingerprint": f"{0:016x}"}
READ_ONE_BATCH = {"batches": 1, "epoch": 0, "epoch_batches": 1, "windows": 3, "fingerprint": f"{7:016x}",
                  "start": START}  # one rank's WorkerBatches.progress() after one batch of 3 windows


def test_a_hung_round_is_abandoned_after_the_bound_and_the_region_catches_up_at_its_next_round(tmp_path):
    with hung_region(tmp_path, "hung", hang_seconds=30) as (a, b, released, read_records):
        before = a.digest()

        async def scenario():  # one event loop: asyncio.run would wait for the hung thread at its end
            first = await asyncio.gather(asyncio.wait_for(a.exchange(0, 0, 1, trained(a, 10), tokens=1000,
                                                                     progress=READ_ONE_BATCH), 60),
                                         b.exchange(0, 0, 1, trained(b, 11), tokens=1000))
            seen = ([e for e in a.events if e["event"] == "round_abandoned"], list(a.history), a.tokens)
            a.sharer.records = read_records
            released.set()
            del a._await_bound  # the real bound again: the next round's rendezvous and re-sync take seconds
            # a's next window: it is a round behind b, takes b's state and averages alone (b trains no more).
            again = await asyncio.wait_for(a.exchange(0, 0, 1, trained(a, 12), tokens=1000), 120)
            return first, seen, again

        ((step_a, rows_a, stop_a), (step_b, _, _)), (abandoned, *counted), (step_again, _, _) = asyncio.run(scenario())
    assert step_b == 1 and b.last_round()["group_size"] == 1  # b went alone: a never came
    # a's round was abandoned: the outer step and θ_global are those its workers had, and they go on from them.
    assert (step_a, stop_a) == (0, False) and len(abandoned) == 1 and abandoned[0]["workers_step"] == 0, a.events
    assert state_digest(from_wire(rows_a)) == before
    assert counted == [[], 0]  # nothing of that round counted
    # but its batches were read: a group restarted now reads on after them (the sim's model: the window is consumed)
    assert a.progress["batches"] == 1 and a.progress["windows"] == 3
    resync = [e for e in a.events if e["event"] == "resync"]
    assert resync and resync[0]["to_step"] == 1 and step_again == 2, a.events
    assert [r["outer_step"] for r in a.history] == [1] and a.tokens == 1000  # the round after, counted


def test_rounds_abandoned_one_after_the_other_end_in_an_error_for_ray_train_to_handle(tmp_path):
    """A DHT that stays hung: after ABANDONED_ROUNDS_LIMIT rounds in a row the exchange raises to the workers (Ray
    Train restarts the group, run.max_failures counts it) instead of training the same window for ever."""
    from ray_diloco.sync.policy import ABANDONED_ROUNDS_LIMIT

    with hung_region(tmp_path, "hung-on", hang_seconds=60) as (a, _, released, _):
        async def windows():
            steps = []
            for window in range(ABANDONED_ROUNDS_LIMIT):
                try:
                    steps.append((await a.exchange(0, 0, 1, trained(a, window), tokens=1000))[0])
                except RuntimeError as error:
                    steps.append(str(error))
            released.set()
            return steps

        steps = asyncio.run(windows())
    assert steps[:-1] == [0] * (ABANDONED_ROUNDS_LIMIT - 1), steps
    assert f"{ABANDONED_ROUNDS_LIMIT} rounds in a row did not end" in steps[-1], steps
    assert [e["in_a_row"] for e in a.events if e["event"] == "round_abandoned"] == list(
        range(1, ABANDONED_ROUNDS_LIMIT + 1))


def test_overlapped_rounds_that_hang_one_after_the_other_also_end_in_an_error(tmp_path):
    """The same hung DHT with outer.overlap: each round runs while the workers train the next window, and the next
    exchange abandons it after the bound. These abandoned rounds count too: before, they were never counted, and
    the region trained on for ever without averaging, each abandoned round leaving a thread blocked."""
    from ray_diloco.sync.policy import ABANDONED_ROUNDS_LIMIT

    # No round here is the run's last (that one blocks).
    with hung_region(tmp_path, "hung-overlapped", hang_seconds=120, outer_steps=10 * ABANDONED_ROUNDS_LIMIT,
                     overlap=True) as (a, _, released, _):

        async def windows():
            steps, step = [], 0
            for window in range(ABANDONED_ROUNDS_LIMIT + 1):  # the first round's abandon comes with the second
                try:
                    step = (await asyncio.wait_for(a.exchange(step, 0, 1, trained(a, window), tokens=1000), 60))[0]
                    steps.append(step)
                except RuntimeError as error:
                    steps.append(str(error))
                    break
            released.set()
            return steps

        steps = asyncio.run(windows())
    assert steps[:-1] == [1] * ABANDONED_ROUNDS_LIMIT, steps  # handed back at once, each a window ahead
    assert f"{ABANDONED_ROUNDS_LIMIT} rounds in a row did not end" in str(steps[-1]), steps
    assert [e["in_a_row"] for e in a.events if e["event"] == "overlapped_round_abandoned"] == list(
        range(1, ABANDONED_ROUNDS_LIMIT + 1)), a.events


def test_a_group_restarting_while_an_overlapped_round_hangs_reads_on_after_that_rounds_window(tmp_path):
    """A group that restarts (a worker died) while its overlapped round hangs: `resume_state` waits the bound for
    the round, abandons it and hands the new group the region's data position. That window's batches were read and
    its Δ is lost with the round: the new group reads on after them. Before, the position was the one before that
    window, and the window was trained twice."""
    with hung_region(tmp_path, "hung-restart", hang_seconds=120, outer_steps=10, overlap=True) as (a, _, released, _):
        async def restart():
            handed_back = await asyncio.wait_for(a.exchange(0, 0, 1, trained(a, 0), tokens=1000,
                                                            progress=READ_ONE_BATCH), 60)
            resumed = await asyncio.wait_for(a.resume_state(0, 1), 60)  # the new group's handshake
            released.set()
            return handed_back, resumed

        (step, _, _), resumed = asyncio.run(restart())
    assert step == 1  # the round overlapped: handed back at once, a window ahead
    assert [e["event"] for e in a.events].count("overlapped_round_abandoned") == 1, a.events
    assert resumed["outer_step"] == 0  # θ_global as it was: the hung round applied nothing
    progress = resumed["progress"] or {}  # None before: the region's position at its start
    assert progress.get("batches") == 1 and progress.get("windows") == 3, resumed["progress"]
