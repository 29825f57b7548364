"""Property tests of the protocol under preemption notices (tests/protocol_notices.py): the simulator's regions get
notices at any moment, 5 s to 150 s before their deadline (GCP gives 30 s, AWS 120 s) or with none stated (Ray
Train's 120 s, the workers counting from their last look without a notice), and their workers decide as
ray_diloco/worker.py does (`ray_diloco.preemption`).

* With every fault of tests/test_protocol.py besides, blocking and overlapped, the protocol's invariants hold
  (`violations`, and no group trains past its deadline): windows ended early enter the average with their steps'
  weight, and the regions still finish on one state.
* A region alone in the run keeps its inner state at every deadline: the group Ray Train starts next continues from
  a checkpoint of the step it starts from, nothing cut off mid-window, where the notice leaves a look's spacing
  and a round. A lone round here takes a fixed 0.2 s (checkpoints none), so the workers' estimate is exact: this
  checks that their decisions add up, not how good the estimate is. The workers' old rule (no mid-window looks,
  before 70aebf1) breaks it, and so does a mutation (a round under a notice that overlaps); Hypothesis finds each
  (the number of schedules it took is printed). Where the steps are slow, a notice shorter than a ninth of a window
  is kept too (looks at least every LOOK_SECONDS once a window has timed the steps); the old rule (a ninth of a
  window apart, whatever the steps) breaks that, and Hypothesis finds it.
* Without overlap, a notice a mid-window look found (the window trained on, there being time) is told with the
  hand-in and the round's checkpoint saved then (`preemption.told_with_hand_in`): a round that outlasts the last
  one, its deadline before the first look in the round, keeps its step. The workers' old rule (saved at that look)
  breaks it; Hypothesis finds it.
* Notices in the blocking rounds of several regions: tests/test_protocol_notice_rounds.py.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, Phase, example, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample
from protocol_sim import RegionPlan, Rules, Schedule, simulate
from test_protocol import EXAMPLES, MATCHMAKING, MAX_WAIT, PROPERTY_SETTINGS, TTL, overlapped, schedules

from ray_diloco import preemption

# A drain's deadline: GCP's 30 s, AWS's 120 s, any, or none stated (Ray Train's 120 s from its detection)
NOTICE_SECONDS = st.sampled_from([30.0, 120.0, None]) | st.floats(5.0, 150.0)
INNER_STEPS = st.sampled_from([12, 50, 500])
LONE_ROUND = 1.0  # more than a lone region's round takes here (TRANSFER, and no one to wait for)
RESTART_SECONDS = Schedule.restart_seconds  # Ray Train's restart of a group, as the simulator takes it
SEARCH = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
LONG_SEARCH = settings(SEARCH, max_examples=4 * EXAMPLES)


def found_under(strategy, loses, what: str, search: settings = SEARCH) -> Schedule:
    """The first schedule `strategy` draws where `loses(schedule)` is not empty (an old rule's loss), in at most
    `search.max_examples`; the test fails naming `what` where none does. Prints how many schedules it took."""
    tried = 0

    def broken(schedule):
        nonlocal tried
        tried += 1
        return bool(loses(schedule))

    try:
        example = find(strategy, broken, settings=search)
    except NoSuchExample:
        pytest.fail(f"no schedule of {search.max_examples}: {what}")
    print(f"{what}: found after {tried} schedule(s): {example}")
    return example


def look_spacing(window: float, inner_steps: int) -> float:
    """Seconds between the workers' mid-window looks for a notice in a window of `window` seconds."""
    looks = sorted(preemption.looks_within_window(inner_steps))
    return window * (looks[0] if looks else inner_steps) / inner_steps


@st.composite
def noticed(draw, schedule: Schedule) -> Schedule:
    """`schedule` with 0-2 preemption notices per region at any moment of the run, and H of 12, 50 or 500."""
    plans = [dataclasses.replace(plan, notices=tuple(
        (draw(st.floats(0.0, 300.0)), draw(NOTICE_SECONDS)) for _ in range(draw(st.integers(0, 2)))))
        for plan in schedule.regions]
    return dataclasses.replace(schedule, regions=tuple(plans), inner_steps=draw(INNER_STEPS))


@st.composite
def lone_noticed(draw) -> Schedule:
    """One region, no fault but notices (1-3) that each leave at least a look's spacing and a round."""
    window, steps = draw(st.floats(20.0, 60.0)), draw(INNER_STEPS)
    spikes = tuple(draw(st.lists(st.sampled_from([0.0, 3.0, 10.0]), max_size=3)))
    shortest = look_spacing(window + max(spikes, default=0.0), steps) + LONE_ROUND
    # An unstated deadline leaves its 120 s less the time between two looks (the workers count from the last look
    # that found no notice): far more than the premise asks here.
    notices = [(draw(st.floats(0.0, 300.0)), draw(st.none() | st.floats(shortest, max(shortest, 150.0))))
               for _ in range(draw(st.integers(1, 3)))]
    # Not one that comes while Ray Train starts the group after a deadline (restart_seconds): the group sees it only
    # once it trains, so less is left of it than the premise says.
    ends = [at + (preemption.UNSTATED_DEADLINE_SECONDS if left is None else left) for at, left in notices]
    notices = [(at, left) for at, left in notices
               if not any(end <= at < end + RESTART_SECONDS for end in ends)] or notices[:1]
    schedule = Schedule((RegionPlan("a", window, jitter=spikes, notices=tuple(notices)),),
                        target=draw(st.integers(2, 6)),
                        max_wait=MAX_WAIT, matchmaking=MATCHMAKING, ttl=TTL, inner_steps=steps,
                        checkpoint_every=draw(st.sampled_from([0, 1, 2])))
    return overlapped(schedule) if draw(st.booleans()) else schedule


@st.composite
def lone_slow_noticed(draw) -> Schedule:
    """One region of slow steps (windows of 12-60 steps of 1-10 s, no jitter: the next window's steps take what the
    last one's did) and one notice once its group's first window has timed its TIMED_STEP (that step's time, then
    each window's, spaces the looks from then on), that leaves a look's spacing by time (LOOK_SECONDS, or a step
    where a step is longer) and a round: often less than a ninth of the window, the spacing without the step
    times. Half of them come in the first window."""
    steps = draw(st.sampled_from([12, 50, 60]))
    step = draw(st.floats(1.0, 10.0))
    window, spacing = steps * step, max(preemption.LOOK_SECONDS, step)
    timed = preemption.TIMED_STEP * step
    at = draw(st.floats(timed, window) | st.floats(window + LONE_ROUND, 3 * window))
    notice = (at, draw(st.floats(spacing + LONE_ROUND, spacing + 30.0)))
    schedule = Schedule((RegionPlan("a", window, notices=(notice,)),), target=draw(st.integers(3, 6)),
                        max_wait=MAX_WAIT, matchmaking=MATCHMAKING, ttl=TTL, inner_steps=steps,
                        checkpoint_every=draw(st.sampled_from([0, 1, 2])))
    return overlapped(schedule) if draw(st.booleans()) else schedule


def lost_inner_state(schedule: Schedule, rules: Rules = Rules()) -> list[str]:
    """The protocol's violations, and every deadline after which the next group did not continue from a checkpoint
    of its step (one that ended a group that had trained nothing yet costs nothing more: "restarting")."""
    out, found = simulate(schedule, rules)
    return found + [f"notice: {name}'s deadline at {at:.1f}s: {what}" for name, at, what in out.deadlines
                    if what not in ("kept", "restarting")]


# CI's run drew it (other modules loaded, so other draws): the check that no group trains past a deadline ran before
# the window's own cut-off, and flagged b's deadline inside its overlapped window.
DEADLINE_IN_AN_OVERLAPPED_WINDOW = Schedule(
    (RegionPlan("a", 20.0, stop_at=0.0), RegionPlan("b", 20.0, notices=((51.0, 30.0),)),
     RegionPlan("c", 51.0, stop_at=0.0)), target=3, max_wait=MAX_WAIT, matchmaking=MATCHMAKING, ttl=TTL,
    overlap=True, download=90.0, checkpoint_every=0, hangs=frozenset({("a", 0)}), inner_steps=12)


def outlived_a_known_notice(schedule: Schedule, rules: Rules = Rules()) -> list[str]:
    """The protocol's violations, and each deadline that ended a group in a blocking round without that round's
    checkpoint ("outlived") where the workers knew the notice as they handed the round in: a mid-window look had
    found it, and the window trained on (there was time for it and the round as the last one took)."""
    out, found = simulate(schedule, rules)
    known = set(out.known_at_hand_in)
    outlived = [(name, deadline) for name, deadline, what in out.deadlines if what == "outlived"]
    for name, handed_in, ended in out.blocking_rounds:
        if (name, handed_in) in known:
            found += [f"notice: {name} knew of a notice as it handed in the round {handed_in:.1f}-{ended:.1f}s; its "
                      f"deadline at {deadline:.1f}s ended the group there unkept"
                      for region, deadline in outlived if region == name and handed_in < deadline <= ended]
    return found


@st.composite
def known_notice_then_a_late_round(draw) -> Schedule:
    """Two regions; a's notice comes late in one of its windows (a mid-window look may find it), its deadline up to
    6 s after a's hand-in, and in that window b is late (a spike of its own, again every `late + 1` windows): the
    round outlasts the one before it, which the workers took for its length when they trained on."""
    window, late = draw(st.floats(20.0, 60.0)), draw(st.integers(1, 3))
    handed_in = (late + 1) * window  # a's hand-in of that window (its rounds before took no time: b on time)
    at = draw(st.floats(handed_in - window / 2, handed_in))
    left = draw(st.floats(max(1.0, handed_in - at), handed_in - at + 6.0))
    spike = (0.0,) * late + (draw(st.floats(5.0, 45.0)),)
    return Schedule((RegionPlan("a", window, notices=((at, left),)), RegionPlan("b", window, jitter=spike)),
                    target=5, max_wait=MAX_WAIT, matchmaking=MATCHMAKING, ttl=TTL, inner_steps=draw(INNER_STEPS),
                    checkpoint_every=draw(st.sampled_from([0, 1, 2])))


# Found by a search for the old rule (an earlier form of the strategy): a's mid-window look finds the notice (deadline 46.7 s)
# and it trains on; it hands in at 42.0 s, b is 42 s late, and the deadline comes before the first look in the round.
KNOWN_NOTICE_OUTLIVED = Schedule(
    (RegionPlan("a", 20.6407, notices=((38.2374, 8.5084),)), RegionPlan("b", 20.6407, jitter=(0.0, 42.4315))),
    target=5, max_wait=MAX_WAIT, matchmaking=MATCHMAKING, ttl=TTL, inner_steps=50, checkpoint_every=1)


@PROPERTY_SETTINGS
@given(schedules().flatmap(noticed) | schedules().map(overlapped).flatmap(noticed) | known_notice_then_a_late_round())
@example(DEADLINE_IN_AN_OVERLAPPED_WINDOW)
@example(KNOWN_NOTICE_OUTLIVED)
def test_property_notices_with_every_fault_keep_the_invariants(draws_independent_of_loaded_modules, schedule):
    found = outlived_a_known_notice(schedule)
    assert not found, found


def test_property_tests_find_a_known_notice_outlived_in_a_round_the_workers_did_not_tell_it_to():
    """The workers before `notice_watch.notice` counted at the hand-in (worker.py): without overlap, a notice a
    mid-window look had found was not told with the hand-in, and they saved their part at the first look in the round,
    ROUND_LOOK_SECONDS later; a round that outlasted the last one and a deadline before that look left no checkpoint
    of the round's step. Hypothesis must find such a schedule; today's workers keep it."""
    example = found_under(known_notice_then_a_late_round(),
                          lambda schedule: outlived_a_known_notice(schedule, Rules(tells_a_known_notice=False)),
                          "a known notice outlived in a round the workers did not tell it to", LONG_SEARCH)
    assert not outlived_a_known_notice(example)
    assert outlived_a_known_notice(KNOWN_NOTICE_OUTLIVED, Rules(tells_a_known_notice=False))


@PROPERTY_SETTINGS
@given(lone_noticed() | lone_slow_noticed())
def test_property_a_lone_region_keeps_its_inner_state_at_every_deadline(draws_independent_of_loaded_modules, schedule):
    found = lost_inner_state(schedule)
    assert not found, found


def test_property_tests_find_a_short_notice_lost_between_looks_a_ninth_of_a_window_apart(
        draws_independent_of_loaded_modules):
    """The workers before preemption.LOOK_SECONDS looked a ninth of a window apart however slow the steps: a notice
    shorter than that came and went between two looks, the window was cut off and the next group started AdamW anew
    (CI: 3.4 s steps, looks 24 s apart, a 15 s notice; tests/test_notice_hand_in.py). Hypothesis must find such a
    schedule."""
    example = found_under(lone_slow_noticed(), lambda schedule: lost_inner_state(schedule, Rules(looks_by_time=False)),
                          "a short notice lost between looks a ninth of a window apart")
    assert not lost_inner_state(example)


def test_property_tests_find_a_short_notice_lost_in_a_groups_first_window_untimed(
        draws_independent_of_loaded_modules):
    """The workers before preemption.TIMED_STEP had no step time in a group's first window: looks a ninth of the
    window apart (every 56 steps of 1 s at H = 500), and a notice shorter than that came and went between two.
    Hypothesis must find such a schedule."""
    example = found_under(lone_slow_noticed(),
                          lambda schedule: lost_inner_state(schedule, Rules(times_first_window=False)),
                          "a short notice lost between the untimed looks of a group's first window")
    assert not lost_inner_state(example)


def slow_steps_outcome(notice: tuple[float, float], rules: Rules):
    """(deadlines, windows ended early) of region a alone, windows of 60 steps in 200 s (3.3 s each), 3 outer
    steps, one `notice` (when, seconds to its deadline)."""
    schedule = Schedule((RegionPlan("a", 200.0, notices=(notice,)),), target=3, inner_steps=60, checkpoint_every=0)
    out, found = simulate(schedule, rules)
    assert not found, found
    return out.deadlines, out.early


def test_a_15_s_notice_in_a_groups_first_window_of_slow_steps_ends_it_early_and_keeps_it():
    """The first window of 60 steps of 3.3 s, a 15 s notice at 31 s: step 2 timed, the group looks after every step
    from step 3, sees the notice after step 10 (33.3 s) and hands in those 10 steps ("kept"). Untimed, it looked
    after steps 7 and 14 (23.3 s and 46.7 s), never saw it, and the window was cut off at 46 s."""
    assert slow_steps_outcome((31.0, 15.0), Rules()) == ([("a", 46.0, "kept")], [("a", 0, 10)])
    assert slow_steps_outcome((31.0, 15.0), Rules(times_first_window=False)) == ([("a", 46.0, "cut off")], [])


def test_a_15_s_notice_in_a_window_of_slow_steps_ends_it_early_and_keeps_it():
    """Windows of 60 steps of 3.3 s (200 s), a 15 s notice at 230 s, 30 s into the second window: its first window
    timed the steps, so the group looks after every one, sees the notice after step 9 (about 230 s) and hands in
    those 9 steps ("kept"). Looking a ninth of the window apart (after steps 7 and 14: about 223 s and 247 s) it
    never saw it and the window was cut off at 245 s."""
    assert slow_steps_outcome((230.0, 15.0), Rules()) == ([("a", 245.0, "kept")], [("a", 1, 9)])
    assert slow_steps_outcome((230.0, 15.0), Rules(looks_by_time=False)) == ([("a", 245.0, "cut off")], [])


def unstated_deadlines(schedule: Schedule) -> set[tuple[str, float]]:
    """(region, Ray Train's deadline) of the schedule's drains that state none."""
    return {(plan.name, at + preemption.UNSTATED_DEADLINE_SECONDS) for plan in schedule.regions
            for at, left in plan.notices if left is None}


@pytest.mark.parametrize("what, strategy, reached", [
    ("a window ended early and its group waited for the deadline on its checkpoint", lone_noticed(),
     lambda schedule, out: bool(out.early) and any(what == "kept" for _, _, what in out.deadlines)),
    ("a group waited for the deadline on a whole window's checkpoint (no window ended early)", lone_noticed(),
     lambda schedule, out: any(what == "kept" for _, _, what in out.deadlines) and not out.early),
    ("a drain that stated no deadline: the group waited for Ray Train's on its checkpoint", lone_noticed(),
     lambda schedule, out: any(what == "kept" and (name, at) in unstated_deadlines(schedule)
                               for name, at, what in out.deadlines)),
    ("a window ended early was averaged with another region's whole one; all finished on one state",
     schedules(faults=False).flatmap(noticed),
     lambda schedule, out: any(min(r["weights"].values()) < 1 == max(r["weights"].values()) for r in out.rounds)
     and len(out.finished) > 1),
    # Not reached any more: a group woke from its wait for an unstated deadline before Ray Train's (the grace). Its
    # last look without a notice had to be over NOTICE_GRACE_SECONDS before the drain, in a hung round; the workers
    # look every ROUND_LOOK_SECONDS in a round now, and 3,000 schedules with hung rounds found none.
])
def test_the_noticed_schedules_reach_each_path(what, strategy, reached, draws_independent_of_loaded_modules):
    try:
        example = find(strategy, lambda schedule: reached(schedule, simulate(schedule)[0]), settings=SEARCH)
    except NoSuchExample:
        pytest.fail(f"no schedule of {EXAMPLES} reached: {what}")
    assert not simulate(example)[1]


OLD_RULES = {  # and a mutation: the property must catch it too
    "issue 23 (before 70aebf1): a notice was looked for once a round: a window longer than the notice was cut off":
        Rules(looks_mid_window=False),
    "mutation: a round under a notice overlaps, so it cannot be checkpointed": Rules(notice_blocks=False),
}


@pytest.mark.parametrize("fault", sorted(OLD_RULES))
def test_property_tests_find_each_fault_of_the_workers_old_rules(fault, draws_independent_of_loaded_modules):
    example = found_under(lone_noticed(), lambda schedule: lost_inner_state(schedule, OLD_RULES[fault]),
                          f"fault {fault}")
    assert not lost_inner_state(example)
