"""What a group does under a preemption notice (ray_diloco/preemption.py): the rule that decides whether it trains
another window before the deadline. tests/test_elastic.py runs the whole path on a real drained node."""

from ray_diloco.preemption import trains_through_notice


def test_a_group_under_a_preemption_notice_trains_on_only_where_a_window_fits_twice_before_the_deadline():
    assert trains_through_notice(seconds_left=100.0, round_seconds=30.0)
    assert not trains_through_notice(seconds_left=50.0, round_seconds=30.0)  # it might be cut off: wait instead
    assert not trains_through_notice(seconds_left=60.0, round_seconds=30.0)  # exactly twice: no margin left
    assert not trains_through_notice(seconds_left=-5.0, round_seconds=1.0)  # past the deadline, not taken yet
