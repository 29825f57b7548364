"""A round that hangs (a DHT call that never returns) costs that round, never the region's worker group.

Before: the last rank to hand in its shards ran the round with no bound and the others waited twice the actor's
bound, then raised to their workers: a Ray Train failure, and repeated slow rounds used up `max_failures` and
the region left the run. Now the blocking round is abandoned after the bound (`SyncActor._await_bound`): the workers
get θ_global back at the outer step they were at, train the next window from it, and the region catches up with
the others at its next round (re-sync). Real SyncActors, Hivemind and state sharing in this process (no Ray).
"""

from __future__ import annotations

import asyncio
import threading

from ray_diloco.sharding import from_wire
from ray_diloco.sync.actor import SyncActorImpl
from ray_diloco.sync.outer import state_digest
from test_sync_actor import MM, config, trained

BOUND = 4.0  # the actor's bound cut to seconds (it is minutes: max_wait, the averaging timeout, downloads)


def test_a_hung_round_is_abandoned_after_the_bound_and_the_region_catches_up_at_its_next_round(tmp_path):
    cfg = config(tmp_path, "hung", [1, 1], matchmaking_seconds=MM, outer_steps=3)
    cfg["outer"]["max_wait_seconds"] = 3.0
    a = SyncActorImpl(cfg, "r0")
    b = None
    released = threading.Event()
    try:
        b = SyncActorImpl(cfg, "r1", initial_peers=a.multiaddrs())
        a._await_bound = lambda: BOUND  # a test seam: the formula's constant part alone is a minute
        before = a.digest()
        read_records = a.sharer.records

        def hang(*args, **kwargs):  # the DHT read that never answers (until the test lets it)
            released.wait(30)  # (a hang to a bound of 4 s; bounded, so that the test ends before the fix too)
            return read_records(*args, **kwargs)

        a.sharer.records = hang

        async def scenario():  # one event loop: asyncio.run would wait for the hung thread at its end
            first = await asyncio.gather(asyncio.wait_for(a.exchange(0, 0, 1, trained(a, 10), tokens=1000), 60),
                                         b.exchange(0, 0, 1, trained(b, 11), tokens=1000))
            seen = ([e for e in a.events if e["event"] == "round_abandoned"], list(a.history), a.tokens)
            a.sharer.records = read_records
            released.set()
            # a's next window: it is a round behind b, takes b's state and goes on.
            again = await asyncio.wait_for(a.exchange(0, 0, 1, trained(a, 12), tokens=1000), 60)
            return first, seen, again

        ((step_a, rows_a, stop_a), (step_b, _, _)), (abandoned, *counted), (step_again, _, _) = asyncio.run(scenario())
    finally:
        released.set()
        for actor in (b, a):
            if actor is not None:
                actor.shutdown()
    assert step_b == 1 and b.last_round()["group_size"] == 1  # b went alone: a never came
    # a's round was abandoned: the outer step and θ_global are those its workers had, and they go on from them.
    assert (step_a, stop_a) == (0, False) and len(abandoned) == 1 and abandoned[0]["workers_step"] == 0, a.events
    assert state_digest(from_wire(rows_a)) == before
    assert counted == [[], 0]  # nothing of that round counted
    resync = [e for e in a.events if e["event"] == "resync"]
    assert resync and resync[0]["to_step"] == 1 and step_again >= 1, a.events
