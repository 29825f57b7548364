"""A deterministic simulator of the outer-sync protocol: N regions in simulated time.

Real: every decision (`ray_diloco.sync.policy`), the outer Nesterov step (`OuterOptimizer`), the pseudo-gradient,
the codec's rounding on the wire (`weighted_average`, `get_codec`) and `state_digest`, on tiny tensors.
Modelled in protocol_world.py (`World`, which `Simulator` extends): time (an event queue; nothing sleeps), the
DHT, the run's storage, state downloads and Hivemind's averager. Modelled here: a region's workers (H inner steps
on data window `w` move θ by a fixed function of (region, w); the group restarts at any moment and re-takes its
state through the handshake), departures, late joins, and a crash of a whole region that comes back from its checkpoint.
Hosts' clocks: each region decides on its own clock (`RegionPlan.clock_offset`, `clock_drift`). One cluster per
region: a finished region's driver exits (`Schedule.leave_after_finish`), its record and server go, its final
state stays in the run's storage (`policy.with_stored`).
With `Schedule.overlap` (outer.overlap), the workers go on training the next window from the moment they hand
in one, from θ_global before the round plus their drift (ray_diloco.sync.actor); a round still runs only after
the previous one ended, and the last round and checkpointed ones block (`policy.may_overlap`).
`RegionPlan.driver`: regions run by one driver (one Ray cluster) hand their stop request in with their Δ and
decide on their group's gathers (`policy.stops_after_round`); the driver, submitted again, resumes them from the
checkpoints `policy.choose_resume_steps` picks (protocol_driver.py).
`Schedule.checkpoint_every` (run.checkpoint_every): a crashed region resumes from its last checkpoint and trains
the windows since then again (`Outcome.replayed`). `Schedule.nonfinite`: a region whose Δ of that window is
NaN/inf sits the round out and re-syncs from a newer state with `policy.Resync`, or stops (`Outcome.stopped`).
`Schedule.hangs`: a region's blocking round hangs (its Hivemind node stops answering; its record expires) until
`policy.round_bound`, then `policy.overdue_round` abandons it (the workers go on at the same step, the region
re-syncs at its next round: `Outcome.abandoned`) or, the third in a row, fails the group (a Ray Train restart,
`Outcome.failures`; past `Schedule.max_failures` the region leaves the run). An overlapped round that hangs is
abandoned by the next round once it has waited `round_bound` for it (`policy.overdue_in_flight`, counted in the
same row; `Outcome.abandoned_in_flight`), or by the handshake of a group that restarts meanwhile.
`Schedule.hangs_after_step`: a blocking round whose node hangs right after its outer step finishes in the
background (`policy.overdue_round`: FINISH_IN_BACKGROUND; `Outcome.finished_in_background`), and the next round
abandons it the same way (protocol_hangs.py). A hang in the settling after the run's last round is not modelled.
`RegionPlan.notices`: preemption notices, with the workers' own decisions (protocol_notices.py): windows ended early
(their Δ weighted by their steps), rounds under a notice blocking and checkpointed, groups waiting for the deadline
(the drain's, or one counted from their last look where it states none), Ray Train ending the group there wherever
it is (`Outcome.deadlines`).

Besides the rendezvous, settling, join and re-sync machines, the simulated region calls the actor's own
`policy.round_arrival`, `may_overlap`, `published_group`, `checkpoints_at`, `round_bound`, `overdue_round`,
`overdue_in_flight` and `stops_after_round`, and its driver the driver's `choose_resume_steps`; what it still
re-implements is the loop that strings them together (the SyncActor's exchange, `_complete_round` and
`_run_round`).

`Rules` is what the simulated SyncActor does; its defaults are today's code (`ray_diloco.sync.actor`). The tests
swap in the old rules one at a time and show that the properties in `violations` (protocol_model.py) catch each fault.
"""


from __future__ import annotations

from protocol_model import (POLL, REPUBLISH, TRANSFER, Outcome, RegionPlan, Rules, Schedule, _Region, _Request,
                            full_key, initial_theta, violations, window_update)
from protocol_driver import DriverStops
from protocol_hangs import Hangs
from protocol_notices import Notices
from protocol_world import World

from ray_diloco import preemption
from ray_diloco.sync import policy
from ray_diloco.sync.outer import OuterOptimizer, state_digest
from ray_diloco.sync.policy import FINISHED, OUT, READY, UNSETTLED, StateRecord


class Simulator(Hangs, Notices, DriverStops, World):
    """The regions: each one's SyncActor and workers, as a process in the world's simulated time."""

    # -- one region: its SyncActor and its workers -------------------------------------------------------
    def _new_region(self, plan: RegionPlan, incarnation: int, resume: bool, step: int | None) -> _Region:
        """A region's SyncActor starting: from its checkpoint of `step` or its newest (resume), or from the
        initial state."""
        theta, saved = initial_theta(), self.checkpoints.get(plan.name, {}) if resume else {}
        step = max(saved) if step is None and saved else step
        if step is not None:
            theta, momentum, progress = saved[step]
        else:
            step, momentum, progress = 0, {}, 0
        outer = OuterOptimizer(theta, lr=0.7, momentum=0.9, nesterov=True)
        outer.load_momentum(momentum)
        outer.step_count = step
        region = _Region(plan, outer, state_digest(outer.global_state()), progress, incarnation=incarnation,
                         worker_checkpoint=step if saved else None, group_started=self.now)
        self.regions[plan.name] = region
        windows = self.out.windows.setdefault(plan.name, [])
        if len(windows) > progress:  # trained since the last checkpoint (run.checkpoint_every > 1): again now
            self.out.replayed[plan.name] = self.out.replayed.get(plan.name, 0) + len(windows) - progress
            del windows[progress:]
        return region

    def _join(self, region: _Region):
        """As Membership._join_if_behind, then the first publish. Returns False if the region ended (old rule)."""
        name = region.plan.name
        records = self.read(name)
        if records is None and self.rules.dht_errors_fatal:
            self.out.dead[name] = "DHT read failed while joining"
            return False
        own = StateRecord(name, region.outer.step_count, region.digest, 0)
        target = policy.join_target(own, records or [])
        if target is not None:
            yield from self._load(region, target)
        self.publish(region, 0)
        return True

    def _region(self, plan: RegionPlan, incarnation: int, resume: bool, step: int | None):
        region = self._new_region(plan, incarnation, resume, step)
        yield 0.0
        if not (yield from self._join(region)):
            return
        region.round_ended = self.now
        self._started_after_deadlines(region)
        while True:
            trained = yield from self._train_window(region)
            if trained is not None and (yield from self._exchange(region, *trained)):
                return

    def _train_window(self, region: _Region):
        """H inner steps from the region's base (θ_global, or with overlap the θ its workers train from), fewer
        where a preemption notice ends the window early (protocol_notices.py). Returns (window, base θ, local θ, Δ,
        when training started, inner steps trained), or None when the window must be trained again: the group
        restarted mid-window, or its exchange was refused."""
        name, rules, s = region.plan.name, self.rules, self.s
        base_step, base_digest, base_theta = region.stale_base or (
            region.outer.step_count, region.digest, {k: v.clone() for k, v in region.outer.global_state().items()})
        region.stale_base = None
        window = region.progress
        duration = region.last_window_seconds = self._window_seconds(region.plan, window)
        started = self.now
        if region.overlapped is not None:  # trained since the hand-in, while the round ran
            base_theta, started = region.overlapped
            duration = max(0.0, started + duration - self.now)
        trained, end = s.inner_steps, self.now + duration
        early = self._early_end(region, started, region.last_window_seconds)
        if early is not None:  # handed in at a look (one before now: while the round in flight ran)
            end, trained = max(early[0], self.now), early[1]
        restart = next((t for t in self._group_ends(region) if started < t <= end), None)
        if restart is not None:  # the group dies mid-window and restarts: the window is trained again
            if restart not in region.plan.restarts:  # a notice's deadline
                self.out.deadlines.append((name, restart, "cut off"))
            region.overlapped = None  # from θ_global: the restarted group takes the actor's state
            region.group_started = max(restart, self.now)  # a notice from then on is the next group's
            yield max(restart, self.now) - self.now + s.restart_seconds
            function_started = self.now  # its notice watch starts here, before resume_state waits
            if region.hung_node is not None:  # a round hung in flight: resume_state waits the bound, abandons it
                yield self._bound()
                self._node_answers(region)
                self.out.abandoned_by_restart.append((name, region.outer.step_count))
            region.round_ended = self.now
            self._started_after_deadlines(region, function_started)
            return None
        self._no_deadline_passed(region)
        yield end - self.now
        # What the next window's looks use: the steps' time, as the workers take it (their clock stops before the
        # exchange, so not the wait for a round in flight that an overlapped window's end includes here)
        region.step_timing = (region.group_started, region.last_window_seconds / s.inner_steps)
        update = window_update(name, window, base_theta)
        if trained < s.inner_steps:  # those steps' share of the window's update
            self.out.early.append((name, window, trained))
            update = {k: v * (trained / s.inner_steps) for k, v in update.items()}
        local = {k: base_theta[k] - update[k] for k in base_theta}
        if region.overlapped is not None:
            return window, base_theta, local, {k: base_theta[k] - local[k] for k in base_theta}, started, trained
        if rules.check_exchange_step and base_step != region.outer.step_count:
            region.step_timing = None  # (a group that starts anew has timed no window)
            return None  # refused: the group restarts and takes the current state
        if base_digest != region.digest:
            self.out.violations.append(f"base: {name} sent a Δ trained from {base_digest[:6]} against "
                                       f"{region.digest[:6]} (step {region.outer.step_count})")
        return window, base_theta, local, region.outer.pseudo_gradient(local), started, trained

    def _exchange(self, region: _Region, window: int, base_theta: dict, local: dict, delta: dict, started: float,
                  trained: int):
        """As SyncActorImpl._complete_round and its round: overlap or block, sit a non-finite round out, or
        rendezvous, average and step. Returns True when the region ended."""
        name, rules, s = region.plan.name, self.rules, self.s
        came_in = self.now  # the workers are in the exchange from here: a deadline from now on ends them there
        # The workers tell the SyncActor of a notice with their hand-in where the window ended early, where rounds
        # may overlap (they look before the exchange; a window ended early has no look), or where an earlier look
        # found it (preemption.told_with_hand_in); else they look in the round and after it (_after_round).
        early = trained < s.inner_steps
        looks_before = s.overlap or not rules.looks_after_round
        # A notice an earlier look of the group found (the window trained on): the workers know it.
        known = self._known_notice(region, came_in)
        if known:
            self.out.known_at_hand_in.append((name, came_in))
        known = known and rules.tells_a_known_notice

        def look() -> bool:
            region.looks.append(came_in)
            return self._deadline(region, came_in) is not None

        told = preemption.told_with_hand_in(early, looks_before, look, lambda: known)
        if region.hung_node is not None:  # a round hung in flight is waited for first (SyncActorImpl._complete_round)
            if (yield from self._overdue_in_flight(region)) == policy.FAIL:
                region.overlapped = None
                self._consume(region, window)
                return (yield from self._group_failed(region))
            # Its update never comes: the workers' Δ is taken against θ_global, which then holds the progress of
            # both windows (SyncActorImpl._drop_overlap_base).
            base_theta = {k: v.clone() for k, v in region.outer.global_state().items()}
            delta = region.outer.pseudo_gradient(local)
        handed_in = self.now
        # As SyncActorImpl._complete_round: the deadline counts from when the region would be in had its last
        # round blocked (= now without overlap).
        arrived = (policy.round_arrival(self.now, region.round_ended, self.now - started)
                   if rules.blocking_time_deadline else self.now)
        region.overlapped = None
        finite = (name, window) not in s.nonfinite
        if policy.may_overlap(overlap=s.overlap, reached=region.outer.step_count + 1, target=s.target,
                              checkpoint_every=s.checkpoint_every, stopping=self._stopping(region.plan), finite=finite,
                              notice=told and rules.notice_blocks):
            newest = region.outer.global_state()
            region.overlapped = ({k: newest[k] + (local[k] - base_theta[k]) for k in newest}, self.now)
        before_round = (region.outer.step_count, region.digest,
                        {k: v.clone() for k, v in region.outer.global_state().items()})
        abandoned = False
        if not finite:  # as Rounds._skip_nonfinite_round: sit out, take a newer state, or stop
            if not (yield from self._sit_out(region)):
                return True
            result = None
        elif region.overlapped is not None and (name, window) in self.hangs:  # an overlapped round that hangs
            self.hangs.discard((name, window))
            self._node_hangs(region)
            return (yield from self._after_round(region, window, arrived, before_round, advanced=False,
                                                 handed_in=came_in, told=told, early=early))
        elif region.overlapped is None and (name, window) in self.hangs:  # a blocking round that hangs
            self.hangs.discard((name, window))
            if (yield from self._hang(region)) != policy.ABANDON:
                if self.rules.abandon_hung_rounds:  # SyncActor.progress: the restarted group reads on after it
                    self._consume(region, window)
                return (yield from self._group_failed(region))
            result, abandoned = None, True
        else:
            result = yield from self._rendezvous(region, arrived, delta, weight=trained / s.inner_steps)
        if result is False:
            return True
        hangs_after_step = (region.overlapped is None and result is not None
                            and (name, window) in self.hangs_after_step and region.outer.step_count + 1 < s.target)
        if not abandoned and not hangs_after_step:  # a round ended (SyncActorImpl._round): the node answers
            region.abandoned_in_a_row = region.seen_abandoned = 0
        region.round_ended = self.now
        if result is not None or not finite:  # in the SyncActor's history: what the workers' next estimate reads
            region.last_round_seconds = self.now - handed_in
        region.last_exchange_seconds = 0.0 if region.overlapped is not None else self.now - handed_in  # the workers'
        if result is not None:
            averaged, consistent, group, log = result
            rules.outer_step(region.outer, averaged, region.plan.cpu)
            region.digest = state_digest(region.outer.global_state())
            if hangs_after_step:
                self.hangs_after_step.discard((name, window))
                self._publish_hung(region, policy.published_group(group, consistent))
                yield from self._finish_in_background(region, handed_in)
            else:
                self.publish(region, policy.published_group(group, consistent))
            log["after"][name] = full_key(region.outer)
            # The gathers come with the group (matchmaking): a round broken mid-way has them too.
            gathers = [{"region": m, "stop": stop} for m, stop in log["stops"].items()]
            agreement = (log["stops"][name], gathers, log)
        else:
            agreement = None
        return (yield from self._after_round(region, window, arrived, before_round, advanced=not abandoned,
                                             agreement=agreement, handed_in=came_in, told=told, early=early,
                                             in_background=hangs_after_step))

    def _consume(self, region: _Region, window: int) -> None:
        """The window's batches were read: the region's data position moves past it."""
        self.out.windows[region.plan.name].append(window)
        region.progress += 1

    def _group_failed(self, region: _Region):
        """The workers failed with the round's error: Ray Train restarts the group (the SyncActor and its state stay;
        the old actor's group trained the window again), up to run.max_failures times; after that the region leaves
        the run (its driver withdraws its record). Only these failures are counted: the schedule's `restarts` stand
        for those the user's run.max_failures is sized for. Returns True when the region ended."""
        name = region.plan.name
        if not self._ended_before_failure(region):
            failures = self.out.failures[name] = self.out.failures.get(name, 0) + 1
            if failures > self.s.max_failures:
                self.out.dead[name] = f"its group failed {failures} times (run.max_failures {self.s.max_failures})"
                self.alive[name] = 0
                self._leave(name)
                return True
            region.group_started = self.now
        yield self.s.restart_seconds
        region.round_ended = self.now
        self._started_after_deadlines(region)
        return False

    def _after_round(self, region: _Region, window: int, arrived: float, before_round: tuple, advanced: bool,
                     agreement: tuple | None = None, handed_in: float = 0.0, told: bool = False,
                     early: bool = False, in_background: bool = False):
        """The window counted, a checkpoint where the workers take one (not again for an abandoned round, which
        did not advance), then the end (T reached, or a stop), or under a preemption notice the wait for its
        deadline. `agreement`: for a round that averaged, (what the region handed in with its Δ, the group's
        gathers, the round's log); `told`: the workers told the SyncActor of a notice with their hand-in; `early`:
        their window ended early; `in_background`: the round hung after its step and finishes in the background.
        Returns True when the region ended."""
        name, s = region.plan.name, self.s
        if region.outer.step_count > s.target:
            self.out.violations.append(f"overshoot: {name} reached step {region.outer.step_count} > {s.target}")
        self._consume(region, window)
        stopping = self._stop_decision(region, agreement)
        # The workers were in the exchange from `handed_in` until the round's end, or where it overlaps until they
        # were handed back (after the round in flight); a deadline after that cuts their next window off.
        in_exchange_until = self.now if region.overlapped is None else region.overlapped[1]
        if region.overlapped is None:
            self.out.blocking_rounds.append((name, handed_in, self.now))
        # Not told with the hand-in, the workers look while they wait in a blocking round; one found, they save their
        # part then, as they would have at the hand-in (worker.wait_for_round).
        if not told and region.overlapped is None and self.rules.looks_in_round:
            told = self._found_in_round(region, handed_in, in_exchange_until)
        # Under a notice they told, the workers saved their part as they handed in, and the SyncActor commits it as
        # the round ends, the group there or not (SyncActorImpl.exchange).
        # (`before_round`: the step the round started from, after the round in flight, as SyncActorImpl's round_from)
        kept_at_hand_in = (told and self.rules.checkpoint_at_hand_in and policy.commits_hand_in_checkpoint(
            before_round[0], region.outer.step_count, region.overlapped is not None, in_background=in_background))
        ended = yield from self._group_ended_in_round(region, handed_in, in_exchange_until, early=early,
                                                      kept=kept_at_hand_in)
        if stopping and region.overlapped is not None:  # Rounds._stopped_in_flight: they end at their next hand-in
            window_from = region.overlapped[1]
            yield from self._end_window_in_flight(region)  # and checkpoint then (a crash before: no checkpoint)
            cut = self._deadlines_between(region, window_from, self.now)  # the next group ends at once (the stop)
            self.out.deadlines += [(name, deadline, "cut off") for deadline in cut]
            ended = ended or bool(cut)
        # Without overlap the workers look for a notice after the round; a group its deadline ended meanwhile is gone.
        looks_after = not s.overlap and self.rules.looks_after_round
        if looks_after and not ended and not early:  # (a window ended early stands under a notice already)
            region.looks.append(self.now)
        notice = told or (looks_after and self._deadline(region, self.now) is not None)
        # The workers save first, then the SyncActor commits: a group gone commits nothing, but the one Ray Train
        # starts after a stop's round checkpoints (with AdamW anew: SyncActorImpl.resume_state's stop).
        if kept_at_hand_in:
            self._commit(region)
            region.worker_checkpoint = region.outer.step_count
        elif policy.checkpoints_at(region.outer.step_count, s.checkpoint_every, stopping=stopping, advanced=advanced,
                                   notice=notice and not ended) and (stopping or not ended):
            self._commit(region)
            if not ended and region.overlapped is None:  # the workers' part: their inner AdamW state
                region.worker_checkpoint = region.outer.step_count
        if not self.rules.atomic_handshake and any(arrived < t <= self.now for t in region.plan.restarts):
            region.stale_base = before_round  # the old handshake: a group restarted during the round took this
        if region.outer.step_count >= s.target:
            yield from self._settle(region)
            self.out.finished[name] = (region.outer.step_count, region.digest)
            if s.leave_after_finish is not None:
                self._at(self.now + s.leave_after_finish, lambda: self._leave(name))
            return True
        if stopping:
            self._stop(region)
            return True
        if notice and not ended:
            yield from self._wait_out_notice(region)
        return False

    @staticmethod
    def _window_seconds(plan: RegionPlan, window: int) -> float:
        """How long the region's workers take for data window `window` (H inner steps, with its jitter)."""
        return plan.window_seconds + (plan.jitter[window % len(plan.jitter)] if plan.jitter else 0.0)

    def _rendezvous(self, region: _Region, arrived: float, delta: dict, weight: float):
        """As Membership._rendezvous: the same machine, on this region's own clock; `delta` weighted by `weight`
        (its tokens). Returns the averager's result, None if the region finishes without a round, False if it ended
        (a DHT error was fatal: an old rule)."""
        name, rules, s = region.plan.name, self.rules, self.s
        local_arrived, said_ready = self.clock(name, arrived), False
        machine = policy.Rendezvous(target=s.target, arrived=local_arrived, max_wait=s.max_wait,
                                    give_up=local_arrived + s.max_wait + self.download_bound(), poll=POLL,
                                    republish=REPUBLISH, plan=rules.plan_round, chase_bound=rules.chase_bound)
        while True:
            records = self.read(name)
            if records is None and rules.dht_errors_fatal:
                self.out.dead[name] = "DHT read failed before a round"
                return False
            action = machine.next(rules.vote(region), records, self.clock(name))
            if isinstance(action, policy.Publish):
                self._set_phase(region, action.phase, waited=action.waited)
                if action.phase == READY and not said_ready:
                    self.out.ready.append((region.outer.step_count, name, arrived))
                said_ready = action.phase == READY
            elif isinstance(action, policy.Adopt):
                loaded = yield from self._load(region, action.record)
                machine.loaded(loaded)
                if loaded and rules.publish_adoption:
                    self.publish(region, 0)
                elif loaded:
                    yield POLL  # the old actor: the next decision reads the records again
            elif isinstance(action, policy.Sleep):
                yield action.seconds / (1.0 + region.plan.clock_drift)
            elif isinstance(action, policy.Finish):
                return None
            else:
                asked = self.now
                result = yield _Request(name, region.outer.step_count, delta, weight, action.expected,
                                        full_key(region.outer), None, region.incarnation,
                                        stop=self._stopping(region.plan))
                if self.now - asked > s.matchmaking + TRANSFER + 1e-6:
                    self.out.violations.append(f"bounded: {name} waited {self.now - asked:.1f}s in averaging")
                return result
            # A canonical state whose holder died cannot be loaded until its record expires (ttl); a load begun
            # just before the give-up time ends one download after it.
            if self.now - arrived > s.max_wait + max(s.ttl, self.download_bound() + s.download) + POLL + 1e-6:
                self.out.violations.append(f"bounded: {name} waited {self.now - arrived:.1f}s to rendezvous")

    def _sit_out(self, region: _Region):
        """As Rounds._skip_nonfinite_round with Membership._resync_from_newer: publish OUT (nobody waits for us),
        then the same `policy.Resync` machine, on this region's own clock. Returns False if the region stopped."""
        name, s = region.plan.name, self.s
        own_step = region.outer.step_count
        self.out.sat_out.append((name, own_step))
        self._set_phase(region, OUT)
        machine = policy.Resync(own_step=own_step, region=name, poll=POLL,
                                give_up=self.clock(name) + s.max_wait + self.download_bound())
        started = self.now
        while True:
            # Its own clock may run slow (drift up to 1e-4): its give-up time comes that much later here.
            if self.now - started > (s.max_wait + self.download_bound() + s.download + POLL) * 1.001:
                self.out.violations.append(f"bounded: {name} sat out for {self.now - started:.1f}s")
            action = machine.next(self.read(name), self.clock(name))
            if isinstance(action, policy.Adopt):
                loaded = yield from self._load(region, action.record)
                machine.loaded(loaded)
                if loaded:
                    self.publish(region, 0)
                    return True
            elif isinstance(action, policy.Sleep):
                yield action.seconds / (1.0 + region.plan.clock_drift)
            else:  # the region's workers fail with the error; the region ends (its record expires)
                self.out.stopped[name] = action.why
                self._end(name, "depart")
                return False

    def _settle(self, region: _Region):
        if self.rules.settle_at_end is None:
            return
        name, ended, started = region.plan.name, self.clock(region.plan.name), self.now
        machine = policy.Settling(target=self.s.target, ended=ended, max_wait=self.s.max_wait,
                                  give_up=ended + self.s.max_wait + self.download_bound(), poll=POLL,
                                  settle=self.rules.settle_at_end)
        while True:  # as Membership._settle_at_end: the same machine, on this region's own clock
            if self.now - started > self.s.max_wait + self.download_bound() + self.s.download + POLL + 1e-6:
                self.out.violations.append(f"bounded: {name} settled for {self.now - started:.1f}s")
            action = machine.next(self.rules.vote(region), self.read(name), self.clock(name))
            if isinstance(action, policy.Adopt):
                loaded = yield from self._load(region, action.record)
                machine.loaded(loaded)
                if loaded:
                    self.publish(region, 0)
            elif isinstance(action, policy.Sleep):
                yield action.seconds / (1.0 + region.plan.clock_drift)
            else:  # as Membership._settle_at_end: an unchecked end is published as such and not kept as final
                self._set_phase(region, FINISHED if action.settled else UNSETTLED)
                if action.settled:
                    self._keep_final_state(region)
                else:
                    self.out.unsettled.add(name)
                return


def simulate(schedule: Schedule, rules: Rules = Rules()) -> tuple[Outcome, list[str]]:
    out = Simulator(schedule, rules).run()
    return out, violations(schedule, out)
