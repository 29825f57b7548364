"""What a region's group does between a cloud's preemption notice (a spot instance reclaimed) and its deadline.

Once a node of the group is drained (with reason PREEMPTION on a cloud; Ray Train acts on any drain), Ray Train
tells every worker (`ray.train.get_preemption_info`); at the deadline it ends the group and starts one on what is
left. That restart is not one of `run.max_failures` (Ray Train counts it against
`FailureConfig.max_preemption_failures`, unbounded by default), so a spot fleet may be reclaimed any number of
times.

Without more, the group that follows would continue from θ_global but start AdamW anew unless the region's last
round happened to be a `run.checkpoint_every` one. So while a notice stands the group checkpoints every round
(`policy.checkpoints_at(..., notice=True)`), and it starts no window that would not end, with its round and its
checkpoint, before the deadline (`trains_through_notice`): it waits for the deadline on its checkpoint
instead. A notice that comes mid-window is looked for a few times a window, and at least every LOOK_SECONDS of
training once the group has timed its steps (`looks_within_window`; in its first window from its TIMED_STEP on:
`first_window_looks`); where the rest of the window with its round
would not end in time, the group hands in the steps it trained so far
(`hands_in_early`: a shorter window, its Δ weighted by its tokens like any region's), so a window longer than the
notice (H = 500 on GPUs against a cloud's 30 s) is not cut off. Its round still meets the other regions, which hand
in when their own windows end, so it may end after the deadline, the group gone. So where the workers know of the
notice as they hand in (a window ended early, an earlier look found it and they trained on, or a look before an
overlapped exchange), they save their part of the
round's checkpoint then (`worker.save_at_hand_in`: AdamW as they go on with it; θ_global comes from the
SyncActor on load), and the SyncActor commits it as the round ends (`policy.commits_hand_in_checkpoint`):
the group that follows continues from it, AdamW included, however late the round ends. A notice that comes while
the workers wait in a round is looked for every ROUND_LOOK_SECONDS (`worker.wait_for_round`): where the round has
not ended, they tell the SyncActor (the round then blocks), save the same checkpoint, and the SyncActor commits it
for the round (`notice_in_round`, `late_hand_in`). The deadline is a UNIX time set
by the cluster's head; the nodes of one Ray cluster are taken to share a clock (NTP), which the regions, each its
own cluster, never need to.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray.train
import ray.train.collective

# Ray Train ends the group at the deadline; should it not, a bounded wait lets the group train on after it.
NOTICE_GRACE_SECONDS = 60.0
# Ray Train starts its preemption watcher just before the workers' train function: a notice may be detected
# before the function's first look, so the group's start counts as a look this much earlier (a watcher's poll).
WATCHER_LEAD_SECONDS = 5.0
# Mid-window looks for a notice before the group has timed a step (its first window up to TIMED_STEP): at most this
# many a window besides the one at its round (a notice is seen within about a ninth of a window), and never fewer
# than this many inner steps apart: each look is a barrier of the group's ranks (a Ray actor call; two once a notice
# stands), which short windows of fast steps would feel. Later windows look at least as often (LOOK_SECONDS).
LOOKS_PER_WINDOW = 8
MIN_STEPS_BETWEEN_LOOKS = 5
# Where the group's last window says its steps are slow, a mid-window look also comes at least this often, in
# seconds of training: a ninth of a long window can outlast a cloud's notice (in CI, steps of 3.4 s on a loaded
# machine put a window's looks 24 s apart, and a 15 s notice came and went between two). A look is a barrier of
# the group's ranks, and Ray Train's watcher polls as often itself.
LOOK_SECONDS = 5.0
# A group's first window has no last window to time its steps by: it times this inner step (the first holds the
# group's warm-up: allocation, the data stream's start, compilation) and spaces its later looks by it. Without, a
# restarted group's first window of H = 500 steps of 1 s looked 56 s apart, longer than a cloud's 30 s notice.
TIMED_STEP = 2
# While the workers wait in a round (for the other regions, or the round in flight before it), they look as often.
ROUND_LOOK_SECONDS = LOOK_SECONDS
# Where a drain gave no deadline, Ray Train ends the group this long after it detected the preemption
# (ray.train.v2 `DEFAULT_PREEMPTION_DEADLINE_S`; tests/test_preemption.py checks the two agree).
UNSTATED_DEADLINE_SECONDS = 120.0


def deadline_of(notice, unseen_at: float) -> float:
    """When Ray Train ends the group under `notice` (UNIX seconds): the drain's deadline, or where it gave none,
    UNSTATED_DEADLINE_SECONDS after Ray Train detected the preemption. The workers do not learn when that was,
    only that it was after `unseen_at`, the last time they asked and no notice stood; counting from there errs
    early, never late (late, a window thought to fit could be cut off)."""
    if notice.deadline_ms is not None:
        return notice.deadline_ms / 1000
    return unseen_at + UNSTATED_DEADLINE_SECONDS


class NoticeWatch:
    """The group's preemption notice as its workers see it, asked by every rank at the same points (`check`).

    The answer is rank 0's, broadcast by Ray Train, so the same on every rank (no rank decides on its own clock),
    and Ray Train never withdraws a notice (it may widen one: more nodes, an earlier deadline)."""

    def __init__(self) -> None:
        self.notice = None
        self.unseen_at = time.time() - WATCHER_LEAD_SECONDS  # the group's start (a restart has a fresh watch)

    def check(self) -> tuple[object | None, bool]:
        """The notice standing now (None: none), and whether this is the first check to see one. A barrier of the
        group's ranks: each calls it at the same points."""
        # Before asking: rank 0's answer is read before the barrier, so one that came after it would be dated late.
        asked_at = time.time()
        notice = ray.train.get_preemption_info()
        first_seen = notice is not None and self.notice is None
        if notice is None:
            self.unseen_at = asked_at
        self.notice = notice
        return notice, first_seen

    def deadline(self) -> float:
        """When Ray Train ends the group (UNIX seconds); only while a notice stands."""
        return deadline_of(self.notice, self.unseen_at)


def trains_through_notice(seconds_left: float, round_seconds: float) -> bool:
    """Whether a group under a preemption notice starts another window, `seconds_left` before the deadline: only
    where a window with its round and checkpoint (`round_seconds`, as long as the last one took) fits twice over.
    Otherwise the workers wait for the deadline on the checkpoint they just committed. Cut off at the deadline, a
    window is lost, and its round (which the SyncActor ends without the workers) would move θ_global past that
    checkpoint: the group started in its place would then begin AdamW anew."""
    return seconds_left > 2 * round_seconds


def waits_for_deadline(deadline: float, round_seconds: float) -> bool:
    """After a round checkpointed under a notice: whether the group waits for `deadline` rather than train
    another window of `round_seconds` (window, round and checkpoint, as the last took) that might not end before
    it. Rank 0's decision, taken by every rank (a barrier): a rank that trained on while another waited would
    block the group."""
    return ray.train.collective.broadcast_from_rank_zero(
        not trains_through_notice(deadline - time.time(), round_seconds))


def sleep_past_deadline(deadline: float) -> None:
    """Until Ray Train ends the group at `deadline`; returns only where the group outlived it by
    NOTICE_GRACE_SECONDS (the next rounds then find the deadline passed and train on, checkpointing each)."""
    time.sleep(max(0.0, deadline + NOTICE_GRACE_SECONDS - time.time()))


def looks_within_window(inner_steps: int, step_seconds: float | None = None) -> frozenset[int]:
    """After which of a window's inner steps (counted from 1) the group looks for a notice mid-window: evenly
    spaced, never after the last (the round's own look follows it). The same steps on every rank (each look is a
    barrier): `step_seconds` is rank 0's time per inner step in the group's last window (`agreed_step_seconds`),
    None before the group has trained one (its first window then looks by `first_window_looks` once it timed its
    TIMED_STEP).

    Without it: at most LOOKS_PER_WINDOW looks, at least MIN_STEPS_BETWEEN_LOOKS apart. With it, never fewer looks
    than that, and at least one every LOOK_SECONDS of training (every step where a step takes longer); closer than
    MIN_STEPS_BETWEEN_LOOKS only where those steps together take longer than LOOK_SECONDS."""
    every = -(-inner_steps // (LOOKS_PER_WINDOW + 1))  # ceil: at most LOOKS_PER_WINDOW looks before the last step
    in_look_seconds = max(1, int(LOOK_SECONDS / step_seconds)) if step_seconds else inner_steps  # steps in 5 s
    every = max(min(every, in_look_seconds), min(MIN_STEPS_BETWEEN_LOOKS, in_look_seconds))
    return frozenset(range(every, inner_steps, every))


def first_window_looks(inner_steps: int, step_seconds: float) -> frozenset[int]:
    """A group's first window's looks: `looks_within_window` without a step time up to its TIMED_STEP, and after it
    those of `step_seconds`, the time that step took (rank 0's, for every rank: `agreed_step_seconds`). With
    MIN_STEPS_BETWEEN_LOOKS above TIMED_STEP the untimed part is empty: the first look comes after the timed step,
    so a notice during the group's warm-up (its first step, minutes where it compiles) is seen after it."""
    untimed = {look for look in looks_within_window(inner_steps) if look <= TIMED_STEP}
    return frozenset(untimed | {look for look in looks_within_window(inner_steps, step_seconds) if look > TIMED_STEP})


def agreed_step_seconds(trained: int, window_seconds: float) -> float:
    """Rank 0's time per inner step in the window just trained (`trained` steps in `window_seconds`; or in a group's
    first window, its TIMED_STEP), taken by every rank (a barrier): the looks that follow (`looks_within_window`,
    `first_window_looks`) must fall on the same steps on every rank."""
    return ray.train.collective.broadcast_from_rank_zero(window_seconds / max(1, trained))


def told_with_hand_in(ended_early: bool, looks_first: bool, look: Callable[[], bool],
                      known: Callable[[], bool]) -> bool:
    """Whether the workers tell the SyncActor of a notice as they hand in a window, saving their part of the round's
    checkpoint then (`worker.save_at_hand_in`): a window ended early stands under one; where rounds may overlap
    (`looks_first`) they `look` first (a barrier: a notice under which the round must block, or one widened since);
    else one an earlier look found (`known`: their NoticeWatch holds it, and Ray Train never withdraws one), as the
    round may outlast its deadline before the first look in the round. Otherwise they look while the round waits
    and after it. Every rank decides alike (each look, and the NoticeWatch, are rank 0's)."""
    return ended_early or (looks_first and look()) or known()


def hands_in_early(seconds_left: float, rest_seconds: float, round_seconds: float | None) -> bool:
    """Mid-window under a notice, `seconds_left` before the deadline: whether the group ends the window now and
    hands in the steps it trained, rather than train the rest of it (`rest_seconds`) first. It trains the rest only
    where the rest with its round (`round_seconds`: round and checkpoint, as the last took; None where none was
    timed: the first window after the region's SyncActor started, which it then ends) fits twice over, as
    `trains_through_notice` asks of a whole window. Past the deadline (Ray Train did not end the group) the notice
    no longer shortens windows."""
    if seconds_left <= 0:
        return False
    return round_seconds is None or not trains_through_notice(seconds_left, rest_seconds + round_seconds)


def hand_in_decision(deadline: float, rest_seconds: float, round_seconds: float | None) -> bool:
    """`hands_in_early` as rank 0 decides it, taken by every rank (a barrier): the ranks' clocks and step times
    differ, and a rank that ended its window while another trained on would block the group."""
    return ray.train.collective.broadcast_from_rank_zero(
        hands_in_early(deadline - time.time(), rest_seconds, round_seconds))
