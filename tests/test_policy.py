"""The outer-sync policy (ray_diloco.sync.policy), decision by decision, on hand-written records.

* choose_canonical: the highest step wins, then the digest most regions hold, then the largest group, then the
  smallest digest, whatever the order of the records; needs_resync gives None when own is canonical;
* fault 1 of the protocol issue: two regions that each went alone with different digests pick the SAME state
  from the same records (each votes with the record it published), so exactly one of them adopts;
* plan_round waits for live regions that are not ready, runs with exactly the ready ones when all are in, runs
  with those at the deadline (naming the absent ones), never waits for a region sitting the round out, adopts a
  newer or canonical state first, and finishes without a round at the target step (fault 2);
* with the DHT unreadable it waits until the deadline, then runs with the last group it knew (fault 4);
* settle_at_end waits for regions behind the target, then adopts the canonical state or finishes;
* join_target never goes back to a lower step;
* the rest of a round: checkpoints_at, may_overlap (never the last, a checkpointed or a diverged round),
  round_arrival, published_group, and the Resync machine of a region that sat a round out.
"""

from __future__ import annotations

import pytest

from ray_diloco.sync.policy import (
    FINISHED,
    OUT,
    READY,
    Adopt,
    Finish,
    Run,
    StateRecord,
    Resync,
    Sleep,
    Stop,
    Wait,
    checkpoints_at,
    choose_canonical,
    commits_hand_in_checkpoint,
    final_state,
    join_target,
    may_overlap,
    needs_resync,
    newer_state,
    plan_round,
    published_group,
    round_arrival,
    settle_at_end,
    startup_records,
    stops_after_round,
)

R = StateRecord


def test_choose_canonical():
    assert choose_canonical([]) is None
    records = [R("a", 3, "x", 2), R("b", 3, "x", 2), R("c", 3, "y", 3)]
    assert choose_canonical(records).digest == "x"  # the majority digest beats a larger group
    assert choose_canonical(records + [R("d", 4, "z", 1)]) == R("d", 4, "z", 1)  # a higher step beats all
    assert choose_canonical([R("a", 3, "y", 1), R("b", 3, "x", 2)]) == R("b", 3, "x", 2)
    assert choose_canonical([R("b", 3, "y", 2), R("a", 3, "x", 2)]) == R("a", 3, "x", 2)
    tie = [R("c", 5, "q", 2), R("a", 5, "p", 2), R("b", 5, "q", 3), R("d", 5, "p", 1)]
    for order in (tie, tie[::-1], tie[1:] + tie[:1]):
        assert choose_canonical(order) == R("b", 5, "q", 3)
    assert choose_canonical([R("a", 0, "init", 0)]) == R("a", 0, "init", 0)
    # the phase is not part of the vote
    assert choose_canonical([R("a", 3, "y", 1, READY), R("b", 3, "x", 1)]) == R("b", 3, "x", 1)
    # θ_global's majority beside a momentum of its own is a state of its own (issue 24): the lone record naming
    # "evil" momentum loses to the two that name "m", however large the group it declares
    honest = [R("a", 3, "x", 2, momentum_digest="m"), R("b", 3, "x", 2, momentum_digest="m")]
    assert choose_canonical(honest + [R("z", 3, "x", 9, momentum_digest="evil")]).momentum_digest == "m"


def test_needs_resync():
    x1, x2, y = R("a", 3, "x", 2), R("b", 3, "x", 2), R("c", 3, "y", 1)
    assert needs_resync(y, [x1, x2, y]) == x1
    assert needs_resync(x2, [x1, x2, y]) is None
    assert needs_resync(R("c", 2, "old", 3), [x1, x2]) == x1  # behind
    assert needs_resync(R("c", 4, "new", 1), [x1, x2]) is None  # ahead: nothing to load
    assert needs_resync(R("c", 3, "y", 3), [R("a", 3, "x", 2), R("c", 3, "stale", 1)]) is None
    assert needs_resync(R("c", 3, "y", 1), []) is None


def test_two_lone_regions_agree_on_one_state():
    a, b = R("a", 5, "da", 1), R("b", 5, "db", 1)  # each went alone: published group 1
    assert needs_resync(a, [a, b]) is None and needs_resync(b, [a, b]) == a  # 'da' < 'db': b adopts, a keeps
    # the old vote (own record with group 0 against the other's group 1) made each adopt the other's state
    assert needs_resync(R("a", 5, "da", 0), [a, b]) == b and needs_resync(R("b", 5, "db", 0), [a, b]) == a


def plan(own, records, now=10.0, arrived=0.0, max_wait=30.0, target=100, fallback=3):
    return plan_round(own, records, target=target, arrived=arrived, now=now, max_wait=max_wait,
                      fallback_expected=fallback)


def test_plan_round_waits_for_live_regions_then_runs_with_the_ready_ones():
    me = R("a", 4, "d", 2, READY)
    training = R("b", 4, "d", 2)
    assert plan(me, [me, training]) == Wait(30.0, ("b",))
    assert plan(me, [me, R("b", 4, "d", 2, READY)]) == Run(2)
    assert plan(me, [me, R("b", 4, "d", 2, READY), R("c", 4, "d", 2, OUT)]) == Run(2)  # c sits it out
    assert plan(me, [me, training], now=30.0) == Run(1, absent=("b",))  # deadline: without b
    assert plan(me, [me]) == Run(1)  # alone in the run: at once
    # a region behind (it will adopt our state and then be ready) is waited for
    assert plan(me, [me, R("c", 3, "old", 2, READY)]) == Wait(30.0, ("c",))


def test_plan_round_adopts_first_and_never_overshoots_the_target():
    me = R("b", 4, "db", 1, READY)
    ahead = R("a", 5, "da", 1)
    assert plan(me, [me, ahead]) == Adopt(ahead)
    # after adopting step 5 = target the region finishes: no round past the run's last step
    assert plan(R("b", 5, "da", 0, READY), [R("b", 5, "da", 0, READY), ahead], target=5) == Finish()
    # at the target with another digest: no round either; settle_at_end takes the canonical state
    assert plan(R("b", 5, "db", 1, READY), [R("b", 5, "db", 1, READY), ahead], target=5) == Finish()
    # at the target with the DHT unreadable past the deadline: still no round (it used to run alone to T+1)
    assert plan(R("b", 5, "da", 0, READY), None, now=31.0, target=5) == Finish()


def test_plan_round_has_one_deadline_per_round_the_earliest_ready_regions():
    """a ready since 0, b since 20, c not ready: both run at a's deadline (30) with each other, not b alone at 50.
    A ready region's record says how long it has waited when it was published (`waited`)."""
    def ready(name, since, now):
        return R(name, 4, "d", 2, READY, waited=now - since)

    c = R("c", 4, "d", 2)
    assert plan(ready("b", 20, 25), [ready("a", 0, 25), ready("b", 20, 25), c], arrived=20.0, now=25.0) == \
        Wait(30.0, ("c",))
    assert plan(ready("b", 20, 30), [ready("a", 0, 30), ready("b", 20, 30), c], arrived=20.0, now=30.0) == \
        Run(2, absent=("c",))
    assert plan(ready("a", 0, 30), [ready("a", 0, 30), ready("b", 20, 30), c], arrived=0.0, now=30.0) == \
        Run(2, absent=("c",))


def test_plan_round_needs_no_shared_clock():
    """The same round seen from b, whose clock reads 1000 s more and whose a-record is a second old: b's deadline
    is a's, placed on b's clock from what a published, one second late at most."""
    a_published = R("a", 4, "d", 2, READY, waited=24.0)  # at time 24 on a's clock, read by b one second later
    b = R("b", 4, "d", 2, READY, waited=5.0)
    assert plan(b, [a_published, b, R("c", 4, "d", 2)], arrived=1020.0, now=1025.0) == Wait(1031.0, ("c",))


def test_plan_round_with_an_unreadable_dht_is_bounded():
    me = R("a", 4, "d", 2, READY)
    assert plan(me, None, now=10.0) == Wait(30.0)
    assert plan(me, None, now=31.0) == Run(3)


def test_settle_at_end():
    me = R("a", 10, "da", 1)
    behind = R("c", 9, "old", 2)
    done_b = R("b", 10, "db", 1)
    settle = lambda own, records, now=5.0: settle_at_end(own, records, target=10, ended=0.0, now=now,
                                                        max_wait=20.0)
    assert settle(me, [me, behind]) == Wait(20.0, ("c",))
    assert settle(me, [me, behind], now=20.0) == Finish()
    assert settle(done_b, [me, done_b]) == Adopt(me)  # the last round failed mid-way: take the canonical
    assert settle(me, [me, done_b]) == Finish()
    assert settle(me, None) == Wait(20.0) and settle(me, None, now=21.0) == Finish(settled=False)
    # a region that already finished is final: taken even against the smaller digest, without waiting for c
    final_b = R("b", 10, "db", 1, FINISHED)
    assert final_state([me, final_b]) == final_b and final_state([me, done_b]) == me
    assert settle(me, [me, final_b, behind]) == Adopt(final_b)
    assert settle(R("a", 10, "db", 0), [R("a", 10, "db", 0), final_b, behind]) == Finish()


def test_a_starting_region_never_joins_what_a_region_its_driver_starts_stored_before():
    live, stored = [R("a", 1, "a1", 2)], [R("b", 2, "b2", 2), R("c", 3, "c3", 2)]
    # b is started by this driver (resumed at step 1 with a): its stored step 2 is its own earlier life's; c runs
    # in another cluster and may really be ahead.
    records = startup_records(live, stored, started_here={"a", "b"})
    assert records == [R("a", 1, "a1", 2), R("c", 3, "c3", 2)]
    assert join_target(R("a", 1, "a1", 0), startup_records(live, stored[:1], {"a", "b"})) is None
    assert join_target(R("a", 1, "a1", 0), startup_records(live, stored[:1], {"a"})) == R("b", 2, "b2", 2)
    assert startup_records(None, stored[:1], {"a", "b"}) is None  # the DHT did not answer, storage has nothing


def test_join_target_and_newer_state():
    me = R("c", 3, "mine", 0)
    assert join_target(me, [me, R("a", 2, "x", 2)]) is None  # never back to a lower step
    assert join_target(me, [me, R("a", 5, "x", 2), R("b", 5, "y", 1)]) == R("a", 5, "x", 2)
    assert newer_state(3, "c", [me, R("a", 3, "x", 2)]) is None
    assert newer_state(3, "c", [me, R("a", 4, "x", 2)]) == R("a", 4, "x", 2)


def test_a_state_download_is_bounded_by_its_size_at_the_slowest_allowed_link():
    """issue 22 item 3: the whole download used to be bounded by averaging_timeout (120 s) whatever the size: a
    ~200M-parameter model's θ and momentum (1.6 GB) need 128 s at 100 Mbit/s, so every re-sync failed."""
    from ray_diloco.sync.policy import download_seconds

    state_bytes = 2 * 4 * 200_000_000  # θ_global and momentum, fp32
    assert download_seconds(state_bytes, mbps=100.0, at_least=120.0) == pytest.approx(128.0)
    assert download_seconds(state_bytes, mbps=10.0, at_least=120.0) == pytest.approx(1280.0)
    assert download_seconds(1000, mbps=100.0, at_least=120.0) == 120.0  # a tiny model: the floor


def test_checkpoints_every_k_steps_and_where_the_run_stops():
    assert [step for step in range(1, 9) if checkpoints_at(step, 3, stopping=False)] == [3, 6]
    assert not any(checkpoints_at(step, 0, stopping=False) for step in range(1, 9))  # 0: never
    assert checkpoints_at(5, 0, stopping=True) and checkpoints_at(5, 3, stopping=True)
    # after an abandoned round (not advanced): its step was checkpointed when due; again only where the run stops
    assert not checkpoints_at(3, 3, stopping=False, advanced=False) and checkpoints_at(3, 3, True, advanced=False)
    # every round while a preemption notice stands, whatever checkpoint_every says
    assert all(checkpoints_at(step, every, stopping=False, notice=True) for step in range(1, 9) for every in (0, 3))
    # ... an abandoned round's too: the notice's checkpoint is what the group restarted after the deadline loads
    assert checkpoints_at(3, 3, stopping=False, advanced=False, notice=True)
    assert checkpoints_at(4, 0, stopping=False, advanced=False, notice=True)


def test_a_hand_in_checkpoint_is_committed_with_the_state_its_round_reached_unless_abandoned_or_overlapped():
    """The workers' checkpoint saved at a hand-in holds the AdamW state they go on with from the step their round
    reached: committed with θ_global of that step where the round, run blocking from step 3, moved the region on (to
    4, or re-synced to a later one); not after an abandoned round, one finishing in the background, one that
    overlapped, or where no round of its own ran."""
    assert commits_hand_in_checkpoint(3, 4)
    assert commits_hand_in_checkpoint(3, 6)  # re-synced to a later state
    assert not commits_hand_in_checkpoint(3, 3)  # the round was abandoned: the workers checkpoint after it as ever
    assert not commits_hand_in_checkpoint(3, 4, in_background=True)  # tokens and data position not yet counted
    assert not commits_hand_in_checkpoint(3, 4, overlapped=True)  # the state handed back is not θ_global itself
    assert not commits_hand_in_checkpoint(None, 4)  # an overlapped round in flight agreed to stop: no round of its own



@pytest.mark.parametrize("reached, every, stopping, finite, overlaps", [
    (2, 0, False, True, True),
    (5, 0, False, True, False),  # the last round: the workers end on the final state
    (3, 3, False, True, False),  # a checkpointed round: the checkpoint holds the state after it
    (1, 1, False, True, False),  # checkpoint_every 1: no round overlaps
    (2, 3, True, True, False),  # the run stops there (with a checkpoint)
    (2, 0, False, False, False),  # a non-finite Δ: the region takes another's state as it is
])
def test_a_round_overlaps_unless_it_ends_the_run_is_checkpointed_or_diverged(reached, every, stopping, finite,
                                                                             overlaps):
    assert may_overlap(overlap=True, reached=reached, target=5, checkpoint_every=every, stopping=stopping,
                       finite=finite) is overlaps
    # under a preemption notice the round is checkpointed: it never overlaps
    assert not may_overlap(overlap=True, reached=reached, target=5, checkpoint_every=every, stopping=stopping,
                           finite=finite, notice=True)


def test_no_round_overlaps_without_outer_overlap():
    assert not may_overlap(overlap=False, reached=2, target=5, checkpoint_every=0, stopping=False, finite=True)


def test_the_deadline_counts_from_where_a_blocking_region_would_be():
    assert round_arrival(now=100.0, last_round_ended=90.0, window=10.0) == 100.0  # blocking: now
    assert round_arrival(now=100.0, last_round_ended=95.0, window=30.0) == 125.0  # overlapped: one window later


def test_a_round_that_failed_mid_way_publishes_a_group_of_one():
    assert published_group(3, consistent=True) == 3 and published_group(3, consistent=False) == 1


def test_resync_adopts_a_newer_state_retries_a_failed_load_and_stops_after_its_bound():
    machine = Resync(own_step=4, region="a", give_up=100.0, poll=0.5)
    same = [R("a", 4, "x", 1, OUT), R("b", 4, "y", 2, READY)]
    assert machine.next(same, now=10.0) == Sleep(0.5)  # nobody past step 4 yet
    newer = [*same, R("c", 5, "z", 2)]
    assert machine.next(newer, now=20.0) == Adopt(R("c", 5, "z", 2))
    machine.loaded(False)
    assert machine.next(newer, now=21.0) == Sleep(0.5)  # a failed load waits a poll before the next try
    assert machine.next(newer, now=22.0) == Adopt(R("c", 5, "z", 2))
    machine.loaded(False)
    assert isinstance(machine.next(newer, now=101.0), Stop)
    assert isinstance(machine.next(None, now=101.0), Stop)  # the DHT unreadable past the bound
    assert machine.next(None, now=50.0) == Sleep(0.5)


def test_an_overdue_round_finishes_in_the_background_is_abandoned_or_fails_the_workers_at_the_limit():
    from ray_diloco.sync.policy import (ABANDON, ABANDONED_ROUNDS_LIMIT, FAIL, FINISH_IN_BACKGROUND, overdue_round,
                                        round_bound)

    assert overdue_round(applied=True, abandoned_in_a_row=2) == (FINISH_IN_BACKGROUND, 2)  # its step is applied
    assert ABANDONED_ROUNDS_LIMIT == 3
    assert overdue_round(applied=False, abandoned_in_a_row=0) == (ABANDON, 1)
    assert overdue_round(applied=False, abandoned_in_a_row=1) == (ABANDON, 2)
    assert overdue_round(applied=False, abandoned_in_a_row=2) == (FAIL, 3)  # the third in a row
    assert overdue_round(applied=False, abandoned_in_a_row=3) == (FAIL, 4)  # and every one after, until one ends
    # 2 rendezvous/settling waits, 2 all-reduces, 6 downloads, a minute of slack: 2·30 + 2·10 + 6·25 + 60
    assert round_bound(max_wait=30.0, averaging_timeout=10.0, download=25.0) == 290.0


def test_a_round_still_in_flight_at_the_next_rounds_bound_is_abandoned_and_counted_in_the_same_row():
    from ray_diloco.sync.policy import ABANDON, FAIL, overdue_in_flight

    # Whether or not it applied its step: the next round has waited a whole bound for it already.
    assert overdue_in_flight(abandoned_in_a_row=0) == (ABANDON, 1)
    assert overdue_in_flight(abandoned_in_a_row=1) == (ABANDON, 2)
    assert overdue_in_flight(abandoned_in_a_row=2) == (FAIL, 3)  # the third in a row, blocking or overlapped
    assert overdue_in_flight(abandoned_in_a_row=5) == (FAIL, 6)


def test_a_stop_asked_by_a_region_of_the_same_driver_in_the_round_ends_every_such_member_there():
    ours = frozenset({"a", "b"})
    asks = {"region": "a", "stop": True}
    assert stops_after_round(True, [], ours)  # alone, or a round without Hivemind: its own request
    assert not stops_after_round(False, [{"region": "a", "stop": False}, {"region": "b"}], ours)
    assert stops_after_round(False, [asks, {"region": "b", "stop": False}], ours)  # b: a asked
    # Another driver's region (another cluster) stops its own regions only; a forged claim to one of our
    # regions (claimed twice in the group), a non-dict or a non-True flag counts for nothing.
    assert not stops_after_round(False, [{"region": "x", "stop": True}, {"region": "b"}], ours)
    assert not stops_after_round(False, [asks, {"region": "a", "stop": False}, {"region": "b"}], ours)
    assert not stops_after_round(False, ["a", None, {"region": "a", "stop": "yes"}], ours)
    # A gather naming its region by a list or a dict is no claim (it used to raise: every member's round failed).
    assert not stops_after_round(False, [{"region": ["a"], "stop": True}, {"region": {}, "stop": True}], ours)
    # A request that came during the round ends the next one, but for a region alone in its driver: the round's.
    assert not stops_after_round(False, [{"region": "b"}], ours, asked_since=True)
    assert stops_after_round(False, [{"region": "a"}, {"region": "x"}], frozenset({"a"}), asked_since=True)
