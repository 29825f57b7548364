"""Property tests of the protocol under preemption notices in the blocking rounds of several regions (the
simulator, tests/protocol_notices.py; notices drawn as in tests/test_protocol_notices.py). The schedules have no
fault but the notices; half of them have a notice while the fastest region waits in its first round.

* With several regions an early window's round waits for the others' windows and may end after the deadline; the
  workers saved their part of its checkpoint as they handed in and the SyncActor commits it as the round ends, so
  the group that follows still continues from it, AdamW included. Without that hand-in checkpoint (the workers
  before it) Hypothesis finds a schedule where the next group starts AdamW anew.
* With several regions, a notice that comes while the workers wait in a blocking round, with its deadline after
  the round's end but too soon for another window, keeps that round: the workers look as the round ends, checkpoint
  it and wait. The workers' old rule (a look before the exchange only, before c0395b8) breaks it; Hypothesis finds
  that too.
* A notice that comes while the workers wait in a blocking round, its deadline before the round's end, keeps that
  round too: a look in the round (every ROUND_LOOK_SECONDS, worker.wait_for_round) finds it, the workers save their
  part then, and the SyncActor commits it as the round ends. Without those looks Hypothesis finds a schedule where
  the next group starts AdamW anew.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from protocol_notices import Notices
from protocol_sim import RegionPlan, Rules, Schedule, Simulator, simulate, violations
from test_protocol import MATCHMAKING, MAX_WAIT, PROPERTY_SETTINGS, TTL, schedules
from test_protocol_notices import LONG_SEARCH, found_under, noticed

from ray_diloco import preemption

@st.composite
def noticed_in_a_round(draw, schedule: Schedule) -> Schedule:
    """`noticed`, and the fastest region's notice comes while its workers wait in the first round for a slower region,
    its deadline in that round or up to two windows after it: where the looks in and after a round decide what is
    kept. For schedules without faults: every region starts at 0 without jitter, so the fastest hands in at the end of
    its window and the round lasts until the slowest hands in (or max_wait has passed)."""
    schedule = draw(noticed(schedule))
    fastest = min(schedule.regions, key=lambda plan: plan.window_seconds)
    handed_in = fastest.window_seconds
    ends = max(handed_in, min(max(p.window_seconds for p in schedule.regions), handed_in + schedule.max_wait))
    at = draw(st.floats(handed_in, ends))
    in_round = max(1.0, ends - at)
    left = draw(st.floats(1.0, in_round) | st.floats(in_round, in_round + 2 * handed_in))
    plans = tuple(dataclasses.replace(p, notices=((at, left),)) if p is fastest else p for p in schedule.regions)
    return dataclasses.replace(schedule, regions=plans)


# The schedules without faults that the properties of blocking rounds are tested on and the searches for the old
# rules draw from: `noticed`'s notices anywhere, and half of them with a notice in a round.
NOTICED_IN_ROUNDS = (schedules(faults=False).flatmap(noticed)
                     | schedules(faults=False).flatmap(noticed_in_a_round))


def unkept_after_a_blocking_round(schedule: Schedule, rules: Rules = Rules()) -> list[str]:
    """The protocol's violations, and each deadline of a notice that came while a region's workers waited in a
    blocking round and falls after the round's end but too soon for another window with its round (within twice the
    window, jitter being added time: `preemption.trains_through_notice`) where the group was not ended waiting for
    it on that round's checkpoint ("kept"). The workers look for a notice as the round ends, so that round is
    checkpointed and they wait for the deadline. A deadline left without a label (the region finished first, or an
    earlier deadline ended the group that had the notice) is not counted."""
    out, found = simulate(schedule, rules)
    for plan, at, deadline, (name, handed_in, ended), what in notices_in_blocking_rounds(schedule, out):
        if at < ended < deadline <= ended + 2 * plan.window_seconds and (what or "kept") != "kept":
            found.append(f"notice: {name}'s notice at {at:.1f}s came in the round {handed_in:.1f}-"
                         f"{ended:.1f}s; its deadline at {deadline:.1f}s: {what}")
    return found


def notices_in_blocking_rounds(schedule: Schedule, out):
    """(plan, notice time, Ray Train's deadline, the blocking round (region, hand-in, end), the deadline's label or
    None) for each notice that came once its region's workers had handed in a blocking round, and each such round."""
    labels = {(name, at): what for name, at, what in out.deadlines}
    for plan in schedule.regions:
        for at, left in plan.notices:
            deadline = at + Notices._left(plan, left)
            for blocking in out.blocking_rounds:
                if blocking[0] == plan.name and blocking[1] <= at:
                    yield plan, at, deadline, blocking, labels.get((plan.name, deadline))


@PROPERTY_SETTINGS
@given(NOTICED_IN_ROUNDS)
def test_property_a_notice_that_came_in_a_blocking_round_keeps_that_round(draws_independent_of_loaded_modules,
                                                                          schedule):
    found = unkept_after_a_blocking_round(schedule)
    assert not found, found


def test_property_tests_find_the_workers_look_only_before_the_exchange(draws_independent_of_loaded_modules):
    """The workers before c0395b8 looked for a notice before the exchange only, blocking rounds too: a notice that
    came while they waited in the round was seen in the next window, at a mid-window look or not before the
    deadline. Hypothesis must find a schedule where that costs the round ("outlived early", "cut off"). Those
    workers had no mid-window looks either (70aebf1 came later); here today's are kept, so this finds the place of
    the look alone, an old rule grafted onto today's workers. Those workers had no hand-in checkpoint either, which
    now keeps most of what the late look lost (an early window at the next look, its round outliving the group): the
    search is longer, for a window cut off. Nor did they look while they waited in the round (worker.wait_for_round),
    which would find the notice in the round itself: left out here too.
    """
    old_rule = Rules(looks_after_round=False, looks_in_round=False)
    example = found_under(NOTICED_IN_ROUNDS,
                          lambda schedule: unkept_after_a_blocking_round(schedule, old_rule),
                          "the look before the exchange only lost a round that came with its notice", LONG_SEARCH)
    assert not unkept_after_a_blocking_round(example)


def outlived_early(schedule: Schedule, rules: Rules = Rules()) -> list[str]:
    """The protocol's violations, and every deadline that ended a group while the round of its window ended early
    met the other regions, after which the next group started AdamW anew ("outlived early")."""
    out, found = simulate(schedule, rules)
    return found + [f"notice: {name}'s deadline at {at:.1f}s: {what}" for name, at, what in out.deadlines
                    if what == "outlived early"]


# Drawn with 1,500 schedules: d's early window hands in outer step 1 after the others' round of it ended (they waited
# out max_wait), so its round re-synced it to step 2 and reached 3; the first rule committed the hand-in checkpoint
# only for the step after the hand-in, and the group that followed started AdamW anew.
EARLY_ROUND_RESYNCED = Schedule(
    (RegionPlan("a", 20.0), RegionPlan("b", 20.0), RegionPlan("c", 24.0),
     RegionPlan("d", 20.0, notices=((68.0, 30.0), (0.0, 57.0)))),
    target=3, max_wait=MAX_WAIT, matchmaking=MATCHMAKING, ttl=TTL, checkpoint_every=1, inner_steps=12)


@PROPERTY_SETTINGS
@given(NOTICED_IN_ROUNDS)
@example(EARLY_ROUND_RESYNCED)
def test_property_with_several_regions_an_early_round_that_outlives_its_group_keeps_the_inner_state(
        draws_independent_of_loaded_modules, schedule):
    """An early window's round meets the others when their windows end, after the deadline where theirs end late:
    the workers saved their part of its checkpoint as they handed in, and the SyncActor commits it as the round ends,
    so the group that follows continues from it, AdamW included. No fault besides the notices."""
    found = outlived_early(schedule)
    assert not found, found


def test_property_tests_find_the_early_round_outliving_its_group_without_the_hand_in_checkpoint(
        draws_independent_of_loaded_modules):
    """The workers before the hand-in checkpoint saved their part after the round only: a round that ended after the
    deadline left none, and the group that follows started AdamW anew. Hypothesis must find such a schedule."""
    example = found_under(NOTICED_IN_ROUNDS,
                          lambda schedule: outlived_early(schedule, Rules(checkpoint_at_hand_in=False)),
                          "an early round outlived its group without the hand-in checkpoint")
    assert not outlived_early(example)


def test_deadlines_while_the_workers_wait_in_the_exchange_end_the_group_there():
    """Found by review: the workers of an overlapped region wait in the exchange for a round hung in flight (its
    bound, 200 s here); a deadline then went unaccounted and the group trained on past it (now a violation), and a
    second notice of the group Ray Train started meanwhile was missed too."""
    def deadlines(notices):
        schedule = Schedule((RegionPlan("a", 30.0, notices=notices), RegionPlan("b", 30.0)), target=5, overlap=True,
                            checkpoint_every=0, hangs=frozenset({("a", 0)}))
        out, found = simulate(schedule)
        assert not found, found
        return out.deadlines

    assert deadlines(((61.0, 10.0),)) == [("a", 71.0, "outlived")]
    # An early window (the notice at 20 s; no round timed yet), its round hung: both groups end in the exchange.
    assert deadlines(((20.0, 130.0), (120.0, 15.0), (137.0, 20.0))) == [("a", 135.0, "outlived early"),
                                                                       ("a", 157.0, "outlived")]


def test_a_notice_after_an_overlapped_hand_in_cuts_the_window_off_and_is_no_violation():
    """Found by review: the check that no group trains past a deadline ran before the window's own cut-off, so a
    deadline inside an overlapped window (the workers train on from their hand-in) was flagged falsely."""
    schedule = Schedule((RegionPlan("a", 30.0, notices=((35.0, 10.0),)), RegionPlan("b", 60.0)), target=4,
                        overlap=True, checkpoint_every=0)
    out, found = simulate(schedule)
    assert not found, found
    assert out.deadlines == [("a", 45.0, "cut off")]


def test_a_restart_while_the_workers_are_in_the_round_leaves_no_checkpoint_of_its_step():
    """The simulator's fidelity, as for a deadline ("outlived"): a group that Ray Train restarts while its workers
    wait in the round (a hands in at 10 s, b at 14 s) saves no worker part of the round's step, so the SyncActor
    commits no checkpoint of it; the next group starts `restart_seconds` after the restart, from the state after
    the round. Before, the simulator committed the checkpoint and a's next window began as the round ended."""
    schedule = Schedule((RegionPlan("a", 10.0, restarts=(13.5,)), RegionPlan("b", 14.0)), target=2,
                        restart_seconds=2.0)
    simulator = Simulator(schedule, Rules())
    out = simulator.run()
    assert not violations(schedule, out), violations(schedule, out)
    assert sorted(simulator.checkpoints["a"]) == [2] and sorted(simulator.checkpoints["b"]) == [1, 2]
    ready = {(step, name): when for step, name, when in out.ready}
    assert ready[(1, "a")] == pytest.approx(13.5 + 2.0 + 10.0)  # the restarted group's first window
    assert out.restarted_in_round == [("a", 13.5, 1)]
    assert out.finished["a"] == out.finished["b"]


def test_group_ends_in_one_round_are_taken_in_the_order_they_came():
    """Found by review: a notice's deadline (12.5 s) and then a plain restart (13.5 s) while a waits in its round
    (10 s to 14 s): the restart was taken first, the deadline's notice then counted as the next group's, and the
    deadline went unrecorded."""
    schedule = Schedule((RegionPlan("a", 10.0, restarts=(13.5,), notices=((10.5, 2.0),)), RegionPlan("b", 14.0)),
                        target=2)
    out, found = simulate(schedule)
    assert not found, found
    assert out.deadlines == [("a", 12.5, "outlived")] and out.restarted_in_round == [("a", 13.5, 1)]


def outlived_in_a_blocking_round(schedule: Schedule, rules: Rules = Rules()) -> list[str]:
    """The protocol's violations, and each deadline that ended a group in a blocking round without that round's
    checkpoint ("outlived") where the notice came while the workers waited in the round, more than a look's spacing
    (ROUND_LOOK_SECONDS) before its deadline: a look in the round finds it, the workers save their part then, and the
    SyncActor commits it as the round ends (worker.wait_for_round)."""
    out, found = simulate(schedule, rules)
    for _, at, deadline, (name, handed_in, ended), what in notices_in_blocking_rounds(schedule, out):
        if at + preemption.ROUND_LOOK_SECONDS < deadline <= ended and what == "outlived":
            found.append(f"notice: {name}'s notice at {at:.1f}s came in the round {handed_in:.1f}-"
                         f"{ended:.1f}s; its deadline at {deadline:.1f}s ended the group there unkept")
    return found


@PROPERTY_SETTINGS
@given(NOTICED_IN_ROUNDS)
def test_property_a_notice_in_a_round_that_outlives_its_group_keeps_the_inner_state(
        draws_independent_of_loaded_modules, schedule):
    found = outlived_in_a_blocking_round(schedule)
    assert not found, found


def test_property_tests_find_a_round_outliving_its_group_without_the_looks_in_the_round(
        draws_independent_of_loaded_modules):
    """The workers before worker.wait_for_round did not look while they waited in a round: a notice that came then,
    its deadline before the round's end (the other regions late), left no checkpoint of the round's step, and the
    group that followed started AdamW anew (CI drew this schedule for tests/test_notice_hand_in.py). Hypothesis must
    find such a schedule."""
    example = found_under(NOTICED_IN_ROUNDS,
                          lambda schedule: outlived_in_a_blocking_round(schedule, Rules(looks_in_round=False)),
                          "a round outlived its group without the looks in the round", LONG_SEARCH)
    assert not outlived_in_a_blocking_round(example)


def test_a_notice_while_the_workers_wait_in_a_round_keeps_that_round_though_the_round_ends_after_its_deadline():
    """a hands in at 10 s and waits for b (30 s); a notice comes at 12 s with 10 s to its deadline. The look at 15 s
    in the round finds it, the workers save their part, and the SyncActor commits it as the round ends at about 31 s,
    the group gone since 22 s: "kept". Without the looks in the round the round left no checkpoint ("outlived")."""
    def deadlines(rules):
        schedule = Schedule((RegionPlan("a", 10.0, notices=((12.0, 10.0),)), RegionPlan("b", 30.0)), target=2,
                            checkpoint_every=0)
        out, found = simulate(schedule, rules)
        assert not found, found
        assert out.blocking_rounds[0][0] == "a" and out.blocking_rounds[0][1:] == pytest.approx((10.0, 30.7))
        return out.deadlines

    assert deadlines(Rules()) == [("a", 22.0, "kept")]
    assert deadlines(Rules(looks_in_round=False)) == [("a", 22.0, "outlived")]
