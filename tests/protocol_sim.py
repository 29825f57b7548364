"""A deterministic simulator of the outer-sync protocol: N regions in simulated time.

Real: every decision (`ray_diloco.sync.policy`), the outer Nesterov step (`OuterOptimizer`), the pseudo-gradient,
the codec's rounding on the wire (`weighted_average`, `get_codec`) and `state_digest`, on tiny tensors.
Modelled: time (an event queue; nothing sleeps), the DHT (records that expire `ttl` after their region died, reads
that fail while a region's DHT is down, publishes that fail and land with the sharer's next refresh), Hivemind's
averager (a group fills at the size the regions expect or at the end of the matchmaking window; a round may fail
mid-way, leaving each member a mix of averaged and own parts), a region's workers (H inner steps on data window
`w` move θ by a fixed function of (region, w); the group restarts at any moment and re-takes its state through
the handshake), departures, late joins, and a crash of a whole region that comes back from its checkpoint.
Hosts' clocks: each region decides on its own clock (`RegionPlan.clock_offset`, `clock_drift`). One cluster per
region: a finished region's driver exits (`Schedule.leave_after_finish`), its record and server go, its final
state stays in the run's storage (`policy.with_stored`).
With `Schedule.overlap` (outer.overlap), the workers go on training the next window from the moment they hand
in one, from θ_global before the round plus their drift (ray_diloco.sync.actor); a round still runs only after
the previous one ended, and the last round and checkpointed ones block (`policy.may_overlap`).
`Schedule.checkpoint_every` (run.checkpoint_every): a crashed region resumes from its last checkpoint and trains
the windows since then again (`Outcome.replayed`). `Schedule.nonfinite`: a region whose Δ of that window is
NaN/inf sits the round out and re-syncs from a newer state with `policy.Resync`, or stops (`Outcome.stopped`).

Besides the rendezvous, settling, join and re-sync machines, the simulated region calls the actor's own
`policy.round_arrival`, `may_overlap`, `published_group` and `checkpoints_at`; what it still re-implements is
the loop that strings them together (the SyncActor's exchange, `_complete_round` and `_run_round`).

`Rules` is what the simulated SyncActor does; its defaults are today's code (`ray_diloco.sync.actor`). The tests
swap in the old rules one at a time and show that the properties in `violations` (protocol_model.py) catch each fault.
"""


from __future__ import annotations

import dataclasses
import heapq
import zlib
from typing import Callable

from protocol_model import (COMPRESSION, POLL, REPUBLISH, TRANSFER, Outcome, RegionPlan, Rules, Schedule, _Region,
                            _Request, full_key, initial_theta, violations, window_update)

from ray_diloco.sync import policy
from ray_diloco.sync.codecs import get_codec
from ray_diloco.sync.outer import OuterOptimizer, state_digest, weighted_average
from ray_diloco.sync.policy import FINISHED, OUT, READY, TRAINING, UNSETTLED, StateRecord


class Simulator:
    def __init__(self, schedule: Schedule, rules: Rules = Rules()):
        self.s, self.rules = schedule, rules
        self.now = 0.0
        self._queue: list = []
        self._seq = 0
        self.out = Outcome()
        self.dht: dict[str, list] = {}  # region -> [record, expires_at]
        self.served: dict[str, tuple] = {}  # region -> (step, digest, θ, momentum) as last published
        self.checkpoints: dict[str, tuple] = {}  # region -> (step, θ, momentum, progress)
        self.stored: dict[str, tuple] = {}  # region -> (final record, θ, momentum): the run's storage
        self.pending: dict[int, list[_Request]] = {}
        self.failing = set(schedule.failing_steps)
        self.regions: dict[str, _Region] = {}
        self.alive: dict[str, int] = {}  # region -> live incarnation (0: down)
        self.stops_served: set[str] = set()  # regions whose stop request was carried out (it comes once)
        self._incarnations = 0

    # -- the event loop ---------------------------------------------------------------------------------
    def _at(self, time: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (time, self._seq, action))

    def run(self, horizon: float = 1e6) -> Outcome:
        for plan in self.s.regions:
            self._at(plan.start_at, lambda p=plan: self._start(p, resume=False))
            for at, kind in ((plan.depart_at, "depart"), (plan.crash_at, "crash")):
                if at is not None:
                    self._at(at, lambda p=plan, k=kind: self._end(p.name, k))
        while self._queue:
            time, _, action = heapq.heappop(self._queue)
            if time > horizon:
                break
            self.now = time
            action()
        for name, incarnation in self.alive.items():
            if incarnation and name not in self.out.finished and name not in self.out.dead:
                self.out.violations.append(f"liveness: {name} neither finished nor failed (stalled)")
        for name, why in self.out.dead.items():
            if name not in self.out.gone:
                self.out.violations.append(f"liveness: {name} ended without finishing: {why}")
        return self.out

    def _resume(self, gen, name: str, incarnation: int, value=None) -> None:
        if self.alive.get(name) != incarnation:
            return  # that incarnation of the region is gone
        try:
            command = gen.send(value)
        except StopIteration:
            return
        if isinstance(command, _Request):
            command.process = gen
            self._submit(command)
        else:
            self._at(self.now + max(float(command), 1e-6), lambda: self._resume(gen, name, incarnation))

    def _start(self, plan: RegionPlan, resume: bool) -> None:
        if plan.name in self.out.gone or (resume and plan.depart_at is not None and plan.depart_at <= self.now):
            return
        self._incarnations += 1  # unique: a dead incarnation's pending wake-ups must never match a new one
        incarnation = self._incarnations
        self.alive[plan.name] = incarnation
        gen = self._region(plan, incarnation, resume)
        self._resume(gen, plan.name, incarnation)

    def _end(self, name: str, kind: str) -> None:
        if kind == "depart":
            self.out.gone.add(name)  # also while down after a crash: it does not come back
        if name in self.out.finished or not self.alive.get(name):
            return
        self.alive[name] = 0
        self.served.pop(name, None)
        if name in self.dht:
            self.dht[name][1] = self.now + self.s.ttl  # no more refreshes: the record expires
        for requests in self.pending.values():
            requests[:] = [r for r in requests if r.region != name]
        if kind != "depart":
            self._at(self.now + self.s.downtime, lambda: self._start(self.regions[name].plan, resume=True))

    # -- the DHT --------------------------------------------------------------------------------------
    def _dht_down(self, name: str) -> bool:
        return any(a <= self.now < b for a, b in self.regions[name].plan.dht_down)

    def clock(self, name: str, at: float | None = None) -> float:
        """What region `name`'s host clock reads at simulated time `at` (default: now)."""
        plan = self.regions[name].plan
        return plan.clock_offset + (1.0 + plan.clock_drift) * (self.now if at is None else at)

    def read(self, name: str) -> list[StateRecord] | None:
        if self._dht_down(name):  # storage still answers (as Membership._read_records)
            return policy.with_stored(None, [record for record, _, _ in self.stored.values()])
        records = [rec for rec, expires in self.dht.values() if expires > self.now]
        records = policy.with_stored(records, [record for record, _, _ in self.stored.values()])
        if self.rules.wall_clock_ready:  # the reader compared the writer's clock with its own
            records = [dataclasses.replace(r, waited=r.waited + self.clock(name) - self.clock(r.region))
                       if r.phase == READY else r for r in records]
        return records

    def _store(self, name: str, incarnation: int) -> None:
        """The sharer stores its newest record; if the DHT is down it tries again at the next refresh."""
        if self.alive.get(name) != incarnation:
            return
        if self._dht_down(name):
            self._at(self.now + self.s.ttl / 3, lambda: self._store(name, incarnation))
            return
        self.dht[name] = [self.regions[name].published, float("inf")]

    def publish(self, region: _Region, group: int, phase: str = TRAINING) -> None:
        region.published = StateRecord(region.plan.name, region.outer.step_count, region.digest, group, phase)
        theta = {k: v.clone() for k, v in region.outer.global_state().items()}
        momentum = {k: v.clone() for k, v in region.outer.momentum_state().items()}
        self.served[region.plan.name] = (region.outer.step_count, region.digest, theta, momentum)
        self._store(region.plan.name, region.incarnation)

    def _set_phase(self, region: _Region, phase: str, waited: float = 0.0) -> None:
        region.published = dataclasses.replace(region.published, phase=phase, waited=waited)
        self._store(region.plan.name, region.incarnation)

    def _keep_final_state(self, region: _Region) -> None:
        """As Membership._keep_final_state: the final record and state, in the run's storage."""
        if self.rules.stored_finals:
            self.stored[region.plan.name] = (region.published, dict(region.outer.global_state()),
                                             dict(region.outer.momentum_state()))

    def _leave(self, name: str) -> None:
        """A finished region's driver exits: its record is withdrawn (a tombstone) and nobody serves its state."""
        self.dht.pop(name, None)
        self.served.pop(name, None)

    def download_bound(self) -> float:
        """As Membership._download_seconds: one download, at least averaging_timeout."""
        return max(self.s.averaging_timeout, self.s.download)

    def _load(self, region: _Region, want: StateRecord):
        """As Membership._adopt: the state of the first holder of `want` (a live server, else the run's storage) is
        taken when the download ends, Schedule.download seconds later, as it was when the download began (the
        sharer serves a frozen snapshot); a live holder that died meanwhile fails it."""
        holders = [(n, v) for n, v in sorted(self.served.items()) if n != region.plan.name and v[:2] == (
            want.outer_step, want.digest)]
        holders += [(None, (r.outer_step, r.digest, theta, momentum))
                    for n, (r, theta, momentum) in sorted(self.stored.items())
                    if n != region.plan.name and (r.outer_step, r.digest) == (want.outer_step, want.digest)]
        if not holders:
            return False
        holder, state = holders[0]
        incarnation = self.alive.get(holder) if holder is not None else None
        if self.s.download > 0:
            yield self.s.download
        if holder is not None and self.alive.get(holder) != incarnation:
            return False
        self._take(region, *state)
        return True

    def _take(self, region: _Region, step: int, digest: str, theta: dict, momentum: dict) -> None:
        if step < region.outer.step_count:
            self.out.violations.append(f"monotonic: {region.plan.name} adopted step {step} at step "
                                       f"{region.outer.step_count}")
        outer = OuterOptimizer(theta, lr=region.outer.lr, momentum=region.outer.momentum, nesterov=True)
        outer.load_momentum(momentum)
        outer.step_count = step
        region.outer, region.digest = outer, digest

    # -- the averager ---------------------------------------------------------------------------------
    def _submit(self, request: _Request) -> None:
        if request.expected == 1:  # RegionAverager.average: alone at once, no matchmaking
            self.pending.setdefault(request.step, [])
            self.pending[request.step], others = [request], self.pending[request.step]
            self._form(request.step)
            self.pending[request.step] = others
            return
        requests = self.pending.setdefault(request.step, [])
        requests.append(request)
        if len(requests) >= max(r.expected for r in requests):
            self._form(request.step)
        else:
            self._at(self.now + self.s.matchmaking, lambda: self._form(request.step, waiting=request))

    def _form(self, step: int, waiting: _Request | None = None) -> None:
        requests = self.pending.get(step, [])
        if waiting is not None and waiting not in requests:
            return  # that request was in a group formed earlier
        self.pending[step] = []
        if not requests:
            return
        members = sorted(requests, key=lambda r: r.region)
        codec = get_codec(COMPRESSION)
        if len(members) == 1:
            results = {members[0].region: ({k: codec.roundtrip(v) for k, v in members[0].delta.items()}, True)}
        else:
            average = weighted_average([m.delta for m in members], [m.weight for m in members], COMPRESSION)
            average = {k: codec.roundtrip(v) for k, v in average.items()}  # reducers send the encoded average
            fails = step in self.failing
            self.failing.discard(step)
            results = {}
            for m in members:  # a round that fails mid-way: some parts stay each member's own
                parts = {k: (codec.roundtrip(m.delta[k]) if fails and zlib.crc32(f"{m.region}{k}".encode()) % 2
                             else average[k]) for k in average}
                results[m.region] = (parts, not fails)
        live = sorted(n for n, inc in self.alive.items() if inc and n not in self.out.finished)
        log = {"step": step, "time": self.now, "members": [m.region for m in members], "live": live,
               "consistent": all(c for _, c in results.values()), "before": {m.region: m.state_key for m in members},
               "after": {}}
        self.out.rounds.append(log)
        for m in members:
            averaged, consistent = results[m.region]
            self._at(self.now + TRANSFER, lambda m=m, a=averaged, c=consistent, g=len(members):
                     self._resume(m.process, m.region, m.incarnation, (a, c, g, log)))

    # -- one region: its SyncActor and its workers -------------------------------------------------------
    def _new_region(self, plan: RegionPlan, incarnation: int, resume: bool) -> _Region:
        """A region's SyncActor starting: from its last checkpoint (resume) or from the initial state."""
        theta = initial_theta()
        if resume and plan.name in self.checkpoints:
            step, theta, momentum, progress = self.checkpoints[plan.name]
        else:
            step, momentum, progress = 0, {}, 0
        outer = OuterOptimizer(theta, lr=0.7, momentum=0.9, nesterov=True)
        outer.load_momentum(momentum)
        outer.step_count = step
        region = _Region(plan, outer, state_digest(outer.global_state()), progress, incarnation=incarnation)
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

    def _region(self, plan: RegionPlan, incarnation: int, resume: bool):
        name, rules, s = plan.name, self.rules, self.s
        region = self._new_region(plan, incarnation, resume)
        yield 0.0
        if not (yield from self._join(region)):
            return
        stale_base = None  # the old handshake: a group restarted during a round took the state of before it
        overlapped = None  # overlap: (the θ the workers train from, when they started) after an overlapped round
        round_ended = self.now  # the end of the region's last round (its start, or its group's restart)
        while True:
            base_step, base_digest, base_theta = stale_base or (
                region.outer.step_count, region.digest, {k: v.clone() for k, v in region.outer.global_state().items()})
            stale_base = None
            window = region.progress
            duration = plan.window_seconds + (plan.jitter[window % len(plan.jitter)] if plan.jitter else 0.0)
            started = self.now
            if overlapped is not None:  # trained since the hand-in, while the round ran
                base_theta, started = overlapped
                duration = max(0.0, started + duration - self.now)
            since = overlapped[1] if overlapped is not None else self.now
            restart = next((t for t in plan.restarts if since < t <= self.now + duration), None)
            if restart is not None:  # the group dies mid-window and restarts: the window is trained again
                overlapped = None  # from θ_global: the restarted group takes the actor's state
                yield max(restart, self.now) - self.now + s.restart_seconds
                round_ended = self.now
                continue
            yield duration
            update = window_update(name, window, base_theta)
            local = {k: base_theta[k] - update[k] for k in base_theta}
            if overlapped is None:
                if rules.check_exchange_step and base_step != region.outer.step_count:
                    continue  # refused: the group restarts and takes the current state
                if base_digest != region.digest:
                    self.out.violations.append(f"base: {name} sent a Δ trained from {base_digest[:6]} against "
                                               f"{region.digest[:6]} (step {region.outer.step_count})")
                delta = region.outer.pseudo_gradient(local)
            else:
                delta = {k: base_theta[k] - local[k] for k in base_theta}
            # As SyncActorImpl._complete_round: the deadline counts from when the region would be in had its
            # last round blocked (= now without overlap).
            arrived = (policy.round_arrival(self.now, round_ended, self.now - started) if rules.blocking_time_deadline
                       else self.now)
            overlapped = None
            finite = (name, window) not in s.nonfinite
            if policy.may_overlap(overlap=s.overlap, reached=region.outer.step_count + 1, target=s.target,
                                  checkpoint_every=s.checkpoint_every, stopping=self._stopping(plan), finite=finite):
                newest = region.outer.global_state()
                overlapped = ({k: newest[k] + (local[k] - base_theta[k]) for k in newest}, self.now)
            before_round = (region.outer.step_count, region.digest,
                            {k: v.clone() for k, v in region.outer.global_state().items()})
            if not finite:  # as Rounds._skip_nonfinite_round: sit out, take a newer state, or stop
                if not (yield from self._sit_out(region)):
                    return
                result = None
            else:
                result = yield from self._rendezvous(region, arrived, delta)
            if result is False:
                return
            round_ended = self.now
            if result is not None:
                averaged, consistent, group, log = result
                rules.outer_step(region.outer, averaged, plan.cpu)
                region.digest = state_digest(region.outer.global_state())
                self.publish(region, policy.published_group(group, consistent))
                log["after"][name] = full_key(region.outer)
            if region.outer.step_count > s.target:
                self.out.violations.append(f"overshoot: {name} reached step {region.outer.step_count} > {s.target}")
            self.out.windows[name].append(window)
            region.progress += 1
            # As the SyncActor: a stop asked before a blocking round ended ends the region there (an overlapped
            # round was handed back at once: the stop comes with the next round, which then blocks).
            stopping = self._stopping(plan) and overlapped is None
            if policy.checkpoints_at(region.outer.step_count, s.checkpoint_every, stopping=stopping):
                self.checkpoints[name] = (region.outer.step_count, dict(region.outer.global_state()),
                                          dict(region.outer.momentum_state()), region.progress)
            if not rules.atomic_handshake and any(arrived < t <= self.now for t in plan.restarts):
                stale_base = before_round
            if region.outer.step_count >= s.target:
                yield from self._settle(region)
                self.out.finished[name] = (region.outer.step_count, region.digest)
                if s.leave_after_finish is not None:
                    self._at(self.now + s.leave_after_finish, lambda: self._leave(name))
                return
            if stopping:
                self._stop(region)
                return

    def _stopping(self, plan: RegionPlan) -> bool:
        return plan.stop_at is not None and plan.stop_at <= self.now and plan.name not in self.stops_served

    def _stop(self, region: _Region) -> None:
        """Its driver ends after the checkpoint (the worker's `checkpoints_at(..., stopping=True)`), withdrawing its
        record (a clean shutdown); submitted again `resubmit_after` later, it continues from that checkpoint."""
        plan, name = region.plan, region.plan.name
        if self.checkpoints.get(name, (None,))[0] != region.outer.step_count:
            self.out.violations.append(f"stop: {name} stopped at step {region.outer.step_count} without a checkpoint "
                                       "of it (resubmitted, it would train windows again)")
        self.stops_served.add(name)
        self.out.stops.append((name, region.outer.step_count))
        self.alive[name] = 0
        self._leave(name)
        for requests in self.pending.values():
            requests[:] = [r for r in requests if r.region != name]
        if plan.resubmit_after is None:
            self.out.gone.add(name)
        else:
            self._at(self.now + plan.resubmit_after, lambda: self._start(plan, resume=True))

    def _rendezvous(self, region: _Region, arrived: float, delta: dict):
        """As Membership._rendezvous: the same machine, on this region's own clock. Returns the averager's result,
        None if the region finishes without a round, False if it ended (a DHT error was fatal: an old rule)."""
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
                result = yield _Request(name, region.outer.step_count, delta, 1.0, action.expected,
                                        full_key(region.outer), None, region.incarnation)
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
