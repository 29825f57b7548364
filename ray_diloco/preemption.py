"""What a region's group does between a cloud's preemption notice (a spot instance reclaimed) and its deadline.

Once a node of the group is drained with reason PREEMPTION, Ray Train tells every worker
(`ray.train.get_preemption_info`); at the deadline it ends the group and starts one on what is left. That restart is
not one of `run.max_failures` (Ray Train counts it against `FailureConfig.max_preemption_failures`, unbounded by
default), so a spot fleet may be reclaimed any number of times.

Without more, the group that follows would continue from θ_global but start AdamW anew unless the region's last
round happened to be a `run.checkpoint_every` one. So while a notice stands the group checkpoints every round
(`policy.checkpoints_at(..., notice=True)`), and it starts no window that would not end, with its round and its
checkpoint, before the deadline (`trains_through_notice`): it waits for the deadline on its checkpoint
instead. The deadline is a UNIX time set by the cluster's head; the nodes of one Ray cluster are taken to share a
clock (NTP), which the regions, each its own cluster, never need to.
"""

from __future__ import annotations

import time

import ray.train
import ray.train.collective

# Ray Train ends the group at the deadline; should it not, a bounded wait lets the group train on after it.
NOTICE_GRACE_SECONDS = 60.0


def standing_notice():
    """The group's preemption notice (`ray.train.PreemptionInfo`), None where none stands: rank 0's, broadcast, so
    the same answer on every rank (no rank decides on its own clock). Ray Train never withdraws a notice. A barrier
    of the group's ranks: each calls it once a round, at the same point."""
    return ray.train.get_preemption_info()


def time_to_deadline(notice) -> float | None:
    """Seconds to the notice's deadline on this host's clock (None: the notice gave no deadline)."""
    return None if notice.deadline_ms is None else notice.deadline_ms / 1000 - time.time()


def trains_through_notice(seconds_left: float, round_seconds: float) -> bool:
    """Whether a group under a preemption notice starts another window, `seconds_left` before the deadline: only
    where a window with its round and checkpoint (`round_seconds`, as long as the last one took) fits twice over.
    Otherwise the workers wait for the deadline on the checkpoint they just committed. Cut off at the deadline, a
    window is lost, and its round (which the SyncActor ends without the workers) would move θ_global past that
    checkpoint: the group started in its place would then begin AdamW anew."""
    return seconds_left > 2 * round_seconds


def waits_for_deadline(notice, round_seconds: float) -> bool:
    """After a round checkpointed under `notice`: whether the group waits for the deadline rather than train
    another window of `round_seconds` (window, round and checkpoint, as the last took) that might not end before
    it. Rank 0's decision, taken by every rank (a barrier): a rank that trained on while another waited would
    block the group."""
    left = time_to_deadline(notice)
    return ray.train.collective.broadcast_from_rank_zero(
        left is not None and not trains_through_notice(left, round_seconds))


def sleep_past_deadline(notice) -> None:
    """Until Ray Train ends the group at the deadline; returns only where the group outlived it by
    NOTICE_GRACE_SECONDS (the next rounds then find the deadline passed and train on, checkpointing each)."""
    time.sleep(max(0.0, notice.deadline_ms / 1000 + NOTICE_GRACE_SECONDS - time.time()))
