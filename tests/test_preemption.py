"""What a group does under a preemption notice (ray_diloco/preemption.py): the rule that decides whether it trains
another window before the deadline, the deadline where the drain stated none, and how the workers see the notice
(Ray Train's calls replaced here by their documented behaviour). tests/test_elastic.py runs the whole path on a
real drained node."""

import pytest
import ray.train
import ray.train.collective
from ray.train.v2.api.preemption import PreemptionInfo

from ray_diloco import preemption
from ray_diloco.preemption import NoticeWatch, deadline_of, trains_through_notice

NODE = "a" * 56  # a node id as Ray writes them


def notice(deadline_ms=None):
    return PreemptionInfo(deadline_ms=deadline_ms, preempted_node_to_ranks={NODE: [1]})


def test_a_group_under_a_preemption_notice_trains_on_only_where_a_window_fits_twice_before_the_deadline():
    assert trains_through_notice(seconds_left=100.0, round_seconds=30.0)
    assert not trains_through_notice(seconds_left=50.0, round_seconds=30.0)  # it might be cut off: wait instead
    assert not trains_through_notice(seconds_left=60.0, round_seconds=30.0)  # exactly twice: no margin left
    assert not trains_through_notice(seconds_left=-5.0, round_seconds=1.0)  # past the deadline, not taken yet


def test_the_deadline_is_the_drains_or_ray_trains_fallback_counted_from_the_last_check_without_a_notice():
    assert deadline_of(notice(deadline_ms=1_700_000_030_500), unseen_at=1_699_999_999.0) == 1_700_000_030.5
    assert deadline_of(notice(), unseen_at=1_000.0) == 1_000.0 + 120.0
    # The fallback is Ray Train's own: its controller ends the group that long after it detected the preemption.
    from ray.train.v2._internal.constants import DEFAULT_PREEMPTION_DEADLINE_S
    assert preemption.UNSTATED_DEADLINE_SECONDS == DEFAULT_PREEMPTION_DEADLINE_S


def test_the_watch_sees_a_notice_first_once_and_dates_an_unstated_deadline_from_the_last_check_without_one(
        monkeypatch):
    now = [100.0]
    monkeypatch.setattr(preemption.time, "time", lambda: now[0])
    answers = iter([None, None, notice(), notice()])  # Ray Train never withdraws a notice

    def get_preemption_info():  # a barrier: the answer comes 3 s after the call
        now[0] += 3.0
        return next(answers)

    monkeypatch.setattr(ray.train, "get_preemption_info", get_preemption_info)
    watch = NoticeWatch()  # the group starts at 100: dated a watcher's poll earlier
    assert watch.check() == (None, False)  # asked at 100, answered at 103: none stands
    now[0] = 110.0
    assert watch.check() == (None, False)  # asked at 110 (not 113: the notice may have come during the barrier)
    now[0] = 120.0
    standing, first_seen = watch.check()
    assert standing == notice() and first_seen
    assert watch.deadline() == 110.0 + 120.0  # Ray Train detected it after the last look without one
    assert watch.check() == (notice(), False)  # still standing: not seen first again, the deadline unchanged
    assert watch.deadline() == 230.0


def test_a_notice_at_the_groups_first_look_is_dated_from_before_the_group_started(monkeypatch):
    monkeypatch.setattr(preemption.time, "time", lambda: 1_000.0)
    monkeypatch.setattr(ray.train, "get_preemption_info", notice)  # detected while the group started
    watch = NoticeWatch()
    assert watch.check() == (notice(), True)
    assert watch.deadline() == 1_000.0 - preemption.WATCHER_LEAD_SECONDS + 120.0


@pytest.mark.parametrize("rank_zero_waits", [True, False])
def test_every_rank_takes_rank_zeros_decision_to_wait(monkeypatch, rank_zero_waits):
    monkeypatch.setattr(preemption.time, "time", lambda: 1_000.0)
    offered = []

    def broadcast_from_rank_zero(value):  # on a rank other than 0: its own value is ignored, rank 0's returned
        offered.append(value)
        return rank_zero_waits

    monkeypatch.setattr(ray.train.collective, "broadcast_from_rank_zero", broadcast_from_rank_zero)
    # 100 s left, rounds of 10 s: this rank alone would train on; it does what rank 0 decided.
    assert preemption.waits_for_deadline(deadline=1_100.0, round_seconds=10.0) is rank_zero_waits
    assert preemption.waits_for_deadline(deadline=1_015.0, round_seconds=10.0) is rank_zero_waits
    assert offered == [False, True]  # what this rank would have decided: train on; wait (15 s < 2 rounds)


def test_the_wait_ends_a_grace_past_the_deadline_where_ray_train_has_not_ended_the_group(monkeypatch):
    slept = []
    monkeypatch.setattr(preemption.time, "time", lambda: 1_000.0)
    monkeypatch.setattr(preemption.time, "sleep", slept.append)
    preemption.sleep_past_deadline(1_030.0)
    preemption.sleep_past_deadline(900.0)  # long past (grace included): no wait
    assert slept == [30.0 + preemption.NOTICE_GRACE_SECONDS, 0.0]


@pytest.mark.parametrize("inner_steps,looks", [
    (50, {6, 12, 18, 24, 30, 36, 42, 48}),  # every ceil(50 / 9) steps: eight looks, none after the last step
    (500, {56, 112, 168, 224, 280, 336, 392, 448}),
    (12, {5, 10}),  # ceil(12 / 9) = 2 steps apart would be barriers too close together: 5
    (5, set()),  # no step both 5 from the start and before the last
    (4, set()),  # a short window: the round's own look is the only one
])
def test_the_group_looks_for_a_notice_a_few_times_a_window_never_after_its_last_step(inner_steps, looks):
    assert preemption.looks_within_window(inner_steps) == looks


@pytest.mark.parametrize("inner_steps,step_seconds,looks", [
    (60, 3.4, set(range(1, 60))),  # a step outlasts LOOK_SECONDS: a look after each (a ninth would be 24 s apart)
    (60, 1.5, set(range(3, 60, 3))),  # int(5 / 1.5) = 3 steps: 4.5 s apart, closer than MIN_STEPS (7.5 s)
    (500, 0.3, set(range(16, 500, 16))),  # GPU-like: 16 steps in 5 s, where a ninth (56 steps) is 17 s
    (60, 0.5, {7, 14, 21, 28, 35, 42, 49, 56}),  # a ninth (3.5 s) comes sooner than 5 s: as without the time
    (20, 0.05, {5, 10, 15}),  # fast steps: a ninth (3) is closer than MIN_STEPS_BETWEEN_LOOKS, which holds
])
def test_where_the_last_window_had_slow_steps_the_group_looks_at_least_every_look_seconds(inner_steps, step_seconds,
                                                                                         looks):
    assert preemption.looks_within_window(inner_steps, step_seconds) == looks


@pytest.mark.parametrize("inner_steps,step_seconds,looks", [
    (500, 1.0, set(range(5, 500, 5))),  # untimed, a look every 56 steps (56 s); by step 2's time, every 5
    (60, 3.4, set(range(3, 60))),  # after every step once step 2 is timed (the looks before it: none)
    (4, 10.0, {3}),  # H = 4 of slow steps: one look, after step 3 (untimed: none)
    (12, 1.0, {5, 10}),  # 5 steps in 5 s: as without the time
    (2, 10.0, set()),  # the window ends at its timed step: the round's own look is the only one
])
def test_a_groups_first_window_spaces_its_looks_by_the_time_of_its_second_step(inner_steps, step_seconds, looks):
    assert preemption.TIMED_STEP == 2  # (the cases above time step 2)
    assert preemption.first_window_looks(inner_steps, step_seconds) == looks


def test_a_window_of_known_step_time_is_looked_at_no_less_often_and_within_look_seconds():
    for inner_steps in (1, 4, 5, 6, 12, 50, 60, 101, 500, 2000):
        without = sorted(preemption.looks_within_window(inner_steps))
        for step_seconds in (0.001, 0.05, 0.3, 0.99, 1.0, 1.7, 4.9, 5.0, 12.0):
            looks = sorted(preemption.looks_within_window(inner_steps, step_seconds))
            assert all(0 < step < inner_steps for step in looks)
            assert len(looks) >= len(without)
            if looks:
                gap = looks[0]
                assert looks == list(range(gap, inner_steps, gap))  # evenly spaced
                assert gap * step_seconds <= max(preemption.LOOK_SECONDS, step_seconds)  # at least every 5 s
                # never closer than MIN_STEPS_BETWEEN_LOOKS, unless those steps take longer than LOOK_SECONDS
                assert gap >= preemption.MIN_STEPS_BETWEEN_LOOKS or (
                    preemption.MIN_STEPS_BETWEEN_LOOKS * step_seconds > preemption.LOOK_SECONDS)


def test_mid_window_looks_are_at_most_eight_spread_over_the_window_and_never_too_close():
    for inner_steps in range(1, 2001):
        looks = sorted(preemption.looks_within_window(inner_steps))
        assert len(looks) <= preemption.LOOKS_PER_WINDOW
        assert all(0 < step < inner_steps for step in looks)
        assert bool(looks) == (inner_steps > preemption.MIN_STEPS_BETWEEN_LOOKS)
        if looks:  # evenly spaced, the last within one spacing of the window's end
            gaps = {b - a for a, b in zip([0] + looks, looks)}
            assert len(gaps) == 1
            gap = gaps.pop()
            assert gap >= preemption.MIN_STEPS_BETWEEN_LOOKS and inner_steps - looks[-1] <= gap


def test_mid_window_a_group_under_a_notice_hands_in_early_unless_the_rest_and_its_round_fit_twice():
    # 40 s of the window left, rounds of 10 s: the rest ends with its round 50 s on, which must fit twice
    assert not preemption.hands_in_early(seconds_left=101.0, rest_seconds=40.0, round_seconds=10.0)
    assert preemption.hands_in_early(seconds_left=100.0, rest_seconds=40.0, round_seconds=10.0)
    assert preemption.hands_in_early(seconds_left=30.0, rest_seconds=1.0, round_seconds=None)  # no round timed yet
    assert not preemption.hands_in_early(seconds_left=-1.0, rest_seconds=1.0, round_seconds=1.0)  # deadline passed
    assert not preemption.hands_in_early(seconds_left=0.0, rest_seconds=1.0, round_seconds=None)


class Actor:
    """The SyncActor's `record_event` as the worker calls it (`.remote`), keeping what it was told."""

    def __init__(self):
        self.events = []
        self.record_event = self

    def remote(self, kind, **details):
        self.events.append((kind, details))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_worker_ends_its_window_early_only_where_a_notice_stands_and_the_rest_would_not_fit(monkeypatch, rank):
    from ray_diloco import worker
    now, offered = [1_000.0], []
    monkeypatch.setattr(preemption.time, "time", lambda: now[0])  # the one `time` module, worker's too

    def broadcast_from_rank_zero(value):  # a barrier of every rank; here the ranks happen to agree
        offered.append(value)
        return value

    monkeypatch.setattr(ray.train.collective, "broadcast_from_rank_zero", broadcast_from_rank_zero)
    answers = iter([None, notice(deadline_ms=1_090_000), notice(deadline_ms=1_090_000)])
    monkeypatch.setattr(ray.train, "get_preemption_info", lambda: next(answers))
    actor, watch = Actor(), NoticeWatch()

    def look(trained):  # inner steps of 0.5 s in a window of 50, then a round of 20 s
        return worker.ends_window_early(actor, watch, "us", rank, 3, trained, 50, 0.5 * trained, 20.0)

    assert not look(10)  # no notice: the window goes on, and nothing is broadcast (every rank got Ray Train's None)
    assert offered == []
    assert not look(10)  # the notice, 90 s left: the rest (40 steps, 20 s) and its round (20 s) fit twice (80 s)
    now[0] = 1_030.0
    assert look(20)  # 60 s left: the rest (30 steps, 15 s) and its round make 35 s, 70 s twice over: it hands in
    assert offered == [False, True]  # one decision broadcast per look under the notice, by every rank
    expected = [("preemption_noticed", {"nodes": [NODE], "ranks": [1], "seconds_left": 90.0, "deadline_stated": True}),
                ("window_ended_early", {"outer_step": 3, "inner_steps": 20, "of": 50, "seconds_left": 60.0})]
    assert actor.events == (expected if rank == 0 else [])  # rank 0 speaks for the group


def test_a_rounds_estimate_is_the_round_as_the_actor_timed_it_where_the_workers_trained_on_plus_the_checkpoint():
    from ray_diloco.worker import round_estimate
    # outer.overlap: the exchange was a hand-in (0.1 s) while the round ran 30 s; under a notice it blocks
    assert round_estimate(0.1, {"seconds": 30.0}, checkpoint_seconds=10.0) == 40.0
    # blocking: the exchange, which waited for the shards too, is the longer
    assert round_estimate(12.0, {"seconds": 11.0}, checkpoint_seconds=2.0) == 14.0
    assert round_estimate(3.0, {}, checkpoint_seconds=0.0) == 3.0  # a rank other than 0 (its value is not used)


@pytest.mark.parametrize("ended_early, looks_first, found, known, told, looked", [
    (True, True, False, False, True, False),    # a window ended early stands under a notice: no look
    (True, False, False, False, True, False),
    (False, True, True, False, True, True),     # overlap: the look before the exchange finds one
    (False, True, False, False, False, True),
    (False, True, False, True, True, True),     # overlap: looked (a widened notice), known anyway
    (False, False, False, True, True, False),   # blocking: an earlier look found it, told with the hand-in
    (False, False, True, False, False, False),  # blocking, none known: no look before the exchange
    (False, False, False, False, False, False),
])
def test_the_workers_tell_a_notice_with_the_hand_in_where_they_know_it(ended_early, looks_first, found, known,
                                                                        told, looked):
    looks = []
    assert preemption.told_with_hand_in(ended_early, looks_first, lambda: looks.append(1) or found,
                                        lambda: known) is told
    assert bool(looks) is looked  # each look is a barrier of every rank: taken exactly where the rule says
