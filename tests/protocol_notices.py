"""Preemption notices in the protocol simulator (`tests/protocol_sim.py`): what a region's workers do between a
cloud's notice and its deadline, with the workers' own decisions (ray_diloco/preemption.py: where the mid-window
looks fall, whether to hand in early, whether to wait for the deadline; `worker.round_estimate`).

A notice (`RegionPlan.notices`: when, and seconds to its deadline) is seen by the workers at their next look:
mid-window (`looks_within_window` of `Schedule.inner_steps` and the time per step its last window took; in the
group's first window, that of its TIMED_STEP: `first_window_looks`), once a round (after it; before the exchange with
outer.overlap), and every ROUND_LOOK_SECONDS while they wait in a blocking round (`worker.wait_for_round`: then they
save their hand-in checkpoint, and the SyncActor commits it as the round ends). A notice an earlier look found is told
with the hand-in, the hand-in checkpoint saved then (`Outcome.known_at_hand_in`). A look that finds the rest of the window with its round would not end in time ends the window there
(`hands_in_early`): its Δ is that many steps' update, weighted by its tokens. A round under a notice blocks
(`policy.may_overlap(..., notice=True)`) and is checkpointed (`policy.checkpoints_at`); after it the group waits for
the deadline where another window with its round might not end before it (`trains_through_notice`). At the deadline
Ray Train ends the group, wherever it is (mid-window, in the exchange, waiting for the deadline, failing, starting),
and starts another `Schedule.restart_seconds` later from the SyncActor's state; a notice that comes after the old
group ended is the new group's. `Outcome.deadlines` says what each deadline left the next group; a group found
training past a deadline is a violation (`_no_deadline_passed`). A deadline while the region sits a non-finite round
out counts as one in the exchange; so does one of the schedule's plain restarts (`RegionPlan.restarts`) that comes
while the workers are in a round (`Outcome.restarted_in_round`: no checkpoint of that step). A drain that states no
deadline gets Ray Train's (UNSTATED_DEADLINE_SECONDS after the drain here), and the workers count theirs from their
last look that found no notice (`region.looks`, `_believed_deadline`), as `preemption.deadline_of` does: never
late. Where that look was long before the drain (a hung round), they wake NOTICE_GRACE_SECONDS past their deadline
and train on (`Outcome.woke_before_deadline`) until Ray Train's cuts them off. Not modelled: a deadline while the
region settles at the run's end (it ends there), the time a checkpoint takes, the barrier of a look (it takes no
time here), Ray Train detecting a drain later than it came, and the looks while the workers wait for the round in
flight before an overlapped one (a notice found there makes the actor's round block; here it is seen at the next
mid-window look).

A mixin of `Simulator`: the world's state lives in protocol_world.py, a region's in protocol_model._Region.
"""

from __future__ import annotations

from protocol_model import RegionPlan, _Region

from ray_diloco import preemption
from ray_diloco.preemption import (NOTICE_GRACE_SECONDS, ROUND_LOOK_SECONDS, UNSTATED_DEADLINE_SECONDS,
                                   WATCHER_LEAD_SECONDS)
from ray_diloco.worker import round_estimate


class Notices:
    """Preemption notices and their deadlines (see the module docstring)."""

    @staticmethod
    def _notices(region: _Region) -> list[tuple[float, float]]:
        """(when, deadline) of the notices of the region's group: those that came once it ran. The group Ray Train
        starts after a deadline runs on other nodes (a draining node takes no new work)."""
        return [(at, at + Notices._left(region.plan, left)) for at, left in region.plan.notices
                if at >= region.group_started]

    @staticmethod
    def _left(plan: RegionPlan, left: float | None) -> float:
        """Seconds from a notice to Ray Train's deadline: the drain's, or where it stated none,
        UNSTATED_DEADLINE_SECONDS of the region's clock (Ray Train's detection taken as the drain itself)."""
        return left if left is not None else UNSTATED_DEADLINE_SECONDS / (1.0 + plan.clock_drift)

    def _believed_deadline(self, region: _Region, when: float) -> float | None:
        """The deadline the workers take at `when` (None: no notice stands), as `preemption.deadline_of`: the
        drain's own, or where it stated none, UNSTATED_DEADLINE_SECONDS after the group's last look that found no
        notice (NoticeWatch.unseen_at: `region.looks` before the group's first notice; its start counts as one
        WATCHER_LEAD_SECONDS earlier). Never later than Ray Train's; the earliest of the notices standing (Ray Train
        may widen a notice to an earlier deadline)."""
        arrived = [at for at, _ in region.plan.notices if region.group_started <= at <= when]
        if not arrived:
            return None
        unseen_at = max((look for look in region.looks if look < min(arrived)), default=min(arrived))
        believed = []
        for at, left in region.plan.notices:
            actual = at + self._left(region.plan, left)
            if at >= region.group_started and at <= when < actual:
                believed.append(actual if left is not None else unseen_at + self._left(region.plan, None))
        return min(believed, default=None)

    def _known_notice(self, region: _Region, when: float) -> bool:
        """Whether a look of the group before `when` found a notice: the workers' NoticeWatch holds it from then on
        (Ray Train never withdraws one). Not the group's start (`looks[0]`, `_start_looking`): it stands for the
        watcher's own start, not a check, and a NoticeWatch starts knowing none."""
        return any(self._deadline(region, look) is not None for look in region.looks[1:] if look < when)

    def _start_looking(self, region: _Region, started: float) -> None:
        """A group's train function starts at `started` with its notice watch (before it registers and waits in
        resume_state); Ray Train's watcher started just before it, so that counts as a look WATCHER_LEAD_SECONDS
        earlier (NoticeWatch)."""
        region.looks = [started - WATCHER_LEAD_SECONDS]

    def _group_ends(self, region: _Region) -> tuple[float, ...]:
        """When Ray Train ends the region's group: its restarts and its notices' deadlines."""
        return tuple(sorted(region.plan.restarts + tuple(deadline for _, deadline in self._notices(region))))

    def _deadline(self, region: _Region, when: float) -> float | None:
        """Ray Train's deadline of the notice the workers find at `when` (None: none stands)."""
        return min((deadline for at, deadline in self._notices(region) if at <= when < deadline), default=None)

    def _seconds_left(self, plan: RegionPlan, deadline: float, when: float) -> float:
        """`deadline` less `when` as the region's cluster reads it (the deadline is a time of its head's clock)."""
        return self.clock(plan.name, deadline) - self.clock(plan.name, when)

    @staticmethod
    def _round_estimate(region: _Region) -> float | None:
        """What the workers take a round with its checkpoint to last (None: neither they nor the SyncActor ran one
        yet). Checkpoints take no time here."""
        if region.last_round_seconds is None and region.last_exchange_seconds is None:
            return None
        last_round = {} if region.last_round_seconds is None else {"seconds": region.last_round_seconds}
        return round_estimate(region.last_exchange_seconds or 0.0, last_round, 0.0)

    def _early_end(self, region: _Region, started: float, full: float) -> tuple[float, int] | None:
        """Where the workers end the window begun at `started` (`full` seconds for H inner steps) early: (when, the
        inner steps trained) at the first mid-window look that finds a notice and the rest of the window with its
        round too long for its deadline (`preemption.hands_in_early`); None where it runs all H steps."""
        if not self.rules.looks_mid_window:  # the workers before 70aebf1: once a round only
            return None
        plan, steps = region.plan, self.s.inner_steps
        timing = region.step_timing
        step_seconds = (timing[1] if self.rules.looks_by_time and timing is not None
                        and timing[0] == region.group_started else None)
        if step_seconds is None and self.rules.looks_by_time and self.rules.times_first_window:
            looks = preemption.first_window_looks(steps, full / steps)  # its TIMED_STEP timed (no warm-up here)
        else:
            looks = preemption.looks_within_window(steps, step_seconds)
        for trained in sorted(looks):
            at = started + full * trained / steps
            deadline = self._believed_deadline(region, at)
            region.looks.append(at)  # (one after a restart cut the window off: the next group looks anew)
            if deadline is not None and preemption.hands_in_early(
                    self._seconds_left(plan, deadline, at), full * (steps - trained) / steps,
                    self._round_estimate(region)):
                return at, trained
        return None

    def _found_in_round(self, region: _Region, came_in: float, until: float) -> bool:
        """As worker.wait_for_round: while the workers wait in a blocking round (from `came_in` to its end, `until`)
        they look for a notice every ROUND_LOOK_SECONDS until the group ends (a deadline, a restart). Whether a look
        found one: the workers then saved their hand-in checkpoint, which the SyncActor took for the round (it had
        not ended: `late_hand_in`) as if they had told it with their hand-in."""
        last = min([until, *(end for end in self._group_ends(region) if end > came_in)])
        at = came_in + ROUND_LOOK_SECONDS
        while at < last:
            region.looks.append(at)
            if self._deadline(region, at) is not None:
                return True
            at += ROUND_LOOK_SECONDS
        return False

    def _group_ended_in_round(self, region: _Region, came_in: float, until: float, early: bool, kept: bool = False):
        """Deadlines and the schedule's restarts that passed while the workers were in the exchange, from `came_in`
        to `until` (the round's end, or an overlapped round's hand-in), in the order they came: each ends the group
        there (the notices of the group Ray Train starts then are its own), so no checkpoint of the round's step (the
        workers save their part after the round, before the SyncActor commits) unless they saved it as they handed
        in under a notice (`kept`: the SyncActor commits it, "kept"); the last group waits in resume_state for the
        round. The next group starts `restart_seconds` after the last end. `early`: the round of a window ended
        early ("outlived early", the first end). Returns whether any did."""
        name, since, ended = region.plan.name, came_in, []
        while True:
            deadline = min((end for _, end in self._notices(region) if since < end <= until), default=None)
            restart = min((t for t in region.plan.restarts if since < t <= until), default=None)
            if deadline is None and restart is None:
                break
            if restart is not None and (deadline is None or restart < deadline):
                self.out.restarted_in_round.append((name, restart, region.outer.step_count))
                since = restart
            else:
                lost = "outlived early" if early and not ended else "outlived"
                self.out.deadlines.append((name, deadline, "kept" if kept else lost))
                since = deadline
            region.group_started = since
            ended.append(since)
        if not ended:
            return False
        yield max(0.0, since + self.s.restart_seconds - self.now)
        region.overlapped, region.round_ended = None, self.now
        self._started_after_deadlines(region, since + self.s.restart_seconds)
        return True

    def _deadlines_between(self, region: _Region, since: float, until: float) -> list[float]:
        """The deadlines of the group's notices in (since, until], earliest first: each ends the group, and the one
        Ray Train starts then has its own notices. `group_started` moves past them."""
        ended = []
        while (deadline := min((end for _, end in self._notices(region) if since < end <= until),
                               default=None)) is not None:
            ended.append(deadline)
            # past it: a notice with no time left (its deadline at its own arrival) is still the group's otherwise
            region.group_started = since = deadline
        return ended

    def _ended_before_failure(self, region: _Region) -> bool:
        """Whether deadlines ended the group before it failed (a hung round's error): they left no checkpoint of the
        step, and the error reached no worker (the group Ray Train started waits in resume_state), so it is no
        failure."""
        ended = self._deadlines_between(region, float("-inf"), self.now)
        self.out.deadlines += [(region.plan.name, deadline, "outlived") for deadline in ended]
        return bool(ended)

    def _started_after_deadlines(self, region: _Region, started: float | None = None) -> None:
        """A group starts training. Deadlines that passed before it trained: while the region's SyncActor started and
        joined, during Ray Train's restart, or while the group waited in resume_state for a round. Ray Train started
        it again; the group had trained nothing, so they cost nothing more ("restarting"; its start is not delayed
        here). `started`: when its train function started (now, unless it waited in resume_state since)."""
        self.out.deadlines += [(region.plan.name, deadline, "restarting")
                               for deadline in self._deadlines_between(region, float("-inf"), self.now)]
        self._start_looking(region, self.now if started is None else started)

    def _no_deadline_passed(self, region: _Region) -> None:
        """The simulator's own check, as a group starts a window: every deadline of its notices that passed ended
        it somewhere (each one accounted moves `group_started` past its notice)."""
        passed = [end for _, end in self._notices(region) if end <= self.now]
        if passed:
            self.out.violations.append(f"notice: {region.plan.name}'s group lived past its deadline {min(passed):.1f}"
                                       f"s (at {self.now:.1f}s)")

    def _wait_out_notice(self, region: _Region):
        """After a round under a notice: the group waits for the deadline where another window with its round
        might not end before it, as `worker.wait_out_notice` (a whole window's time: the last one's, scaled to H);
        the next group starts `restart_seconds` after it from the SyncActor's state."""
        plan = region.plan
        believed = self._believed_deadline(region, self.now)
        if believed is None:
            return
        window_and_round = region.last_window_seconds + self._round_estimate(region)
        if preemption.trains_through_notice(self._seconds_left(plan, believed, self.now), window_and_round):
            return
        # `preemption.sleep_past_deadline`: it wakes NOTICE_GRACE_SECONDS after the deadline it took (at once, past
        # that) and trains on, where Ray Train's deadline of an unstated drain is later still.
        wakes = believed + NOTICE_GRACE_SECONDS / (1.0 + plan.clock_drift)
        # Ray Train ends the group at the first deadline, that of a notice that comes while it waits too.
        deadline = min((end for at, end in self._notices(region) if at < wakes and end > self.now), default=wakes)
        if deadline >= wakes:
            yield max(0.0, wakes - self.now)
            self.out.woke_before_deadline.append((plan.name, self.now))
            return
        kept = region.worker_checkpoint == region.outer.step_count
        region.overlapped = None  # an overlapped round's workers (a mutation the tests check) wait too
        yield deadline - self.now
        self.out.deadlines.append((plan.name, deadline, "kept" if kept else "lost"))
        region.group_started = self.now
        yield self.s.restart_seconds
        region.round_ended = self.now
        self._started_after_deadlines(region)
