"""The world of the protocol simulator (protocol_sim.py): simulated time, the DHT, the run's storage, the state
sharing servers and Hivemind's averager forming groups. The regions themselves (their SyncActors and workers)
live in `protocol_sim.Simulator`, which extends this class; `World.run` starts each region's process there.

Modelled: time (an event queue; nothing sleeps), the DHT (records that expire `ttl` after their region died, reads
that fail while a region's DHT is down, partial and stale views, publishes that fail and land with the sharer's
next refresh), a state download (bounded, failing when its holder goes), and the averager (a group fills at the
size the regions expect or at the end of the matchmaking window; a round may fail mid-way, leaving each member a
mix of averaged and own parts; two groups may form for one round, `Schedule.split_steps`; a member left alone gets
its own Δ back at once here, from Hivemind only after its matchmaking window).
"""

from __future__ import annotations

import dataclasses
import heapq
import zlib
from typing import Callable

from protocol_model import COMPRESSION, TRANSFER, Outcome, RegionPlan, Rules, Schedule, _Region, _Request

from ray_diloco.sync import policy
from ray_diloco.sync.codecs import get_codec
from ray_diloco.sync.outer import OuterOptimizer, weighted_average
from ray_diloco.sync.policy import READY, TRAINING, StateRecord


class World:
    """Simulated time, the DHT, storage, state sharing and the averager; `_region` is the subclass's."""

    def __init__(self, schedule: Schedule, rules: Rules = Rules()):
        self.s, self.rules = schedule, rules
        self.now = 0.0
        self._queue: list = []
        self._seq = 0
        self.out = Outcome()
        self.dht: dict[str, list] = {}  # region -> [record, expires_at]
        self.previous: dict[str, StateRecord] = {}  # region -> the record its newest one replaced (stale views)
        self.served: dict[str, tuple] = {}  # region -> (step, digest, θ, momentum) as last published
        self.checkpoints: dict[str, dict[int, tuple]] = {}  # region -> {step: (θ, momentum, progress)}, the newest
        self.resubmitting: set[str] = set()  # drivers that stopped and will be submitted again (protocol_driver.py)
        self.stored: dict[str, tuple] = {}  # region -> (final record, θ, momentum): the run's storage
        self.pending: dict[int, list[_Request]] = {}
        self.failing = set(schedule.failing_steps)
        self.hangs = set(schedule.hangs)  # each hangs once
        self.hangs_after_step = set(schedule.hangs_after_step)
        self.splitting = set(schedule.split_steps)  # each splits once
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

    def _start(self, plan: RegionPlan, resume: bool, step: int | None = None) -> None:
        """The region's SyncActor and workers start: fresh, or resumed from its checkpoint of `step` (None: its
        newest)."""
        if plan.name in self.out.gone or (resume and plan.depart_at is not None and plan.depart_at <= self.now):
            return
        self._incarnations += 1  # unique: a dead incarnation's pending wake-ups must never match a new one
        incarnation = self._incarnations
        self.alive[plan.name] = incarnation
        gen = self._region(plan, incarnation, resume, step)
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
        return self._within(self.regions[name].plan.dht_down)

    def _within(self, intervals: tuple[tuple[float, float], ...]) -> bool:
        return any(a <= self.now < b for a, b in intervals)

    def _as_seen(self, reader: str, record: StateRecord) -> StateRecord | None:
        """`record` as a read of `reader` sees it: in its partial views, a third of the other regions' records is
        missing and a third is the version before (a different third from one second to the next; never its own:
        the reader's node holds it). None: missed."""
        if record.region == reader or not self._within(self.regions[reader].plan.partial_views):
            return record
        view = zlib.crc32(f"{reader}/{record.region}/{int(self.now)}".encode()) % 3
        seen = None if view == 1 else self.previous.get(record.region, record) if view == 2 else record
        self.out.partial_reads += seen != record
        return seen

    def clock(self, name: str, at: float | None = None) -> float:
        """What region `name`'s host clock reads at simulated time `at` (default: now)."""
        plan = self.regions[name].plan
        return plan.clock_offset + (1.0 + plan.clock_drift) * (self.now if at is None else at)

    def read(self, name: str) -> list[StateRecord] | None:
        if self._dht_down(name):  # storage still answers (as Membership._read_records)
            return policy.with_stored(None, [record for record, _, _ in self.stored.values()])
        records = [self._as_seen(name, rec) for rec, expires in self.dht.values() if expires > self.now]
        records = [rec for rec in records if rec is not None]
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
        stored, newest = self.dht.get(name, [None])[0], self.regions[name].published
        if stored is not None and (stored.outer_step, stored.digest) != (newest.outer_step, newest.digest):
            self.previous[name] = stored  # a stale read sees the state before (not only an older phase of it)
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
        if len(members) > 1 and step in self.splitting:  # Hivemind's matchmaking formed two groups for this round
            self.splitting.discard(step)
            self.out.splits.append(step)
            self._average(step, members[::2])
            self._average(step, members[1::2])
        else:
            self._average(step, members)

    def _average(self, step: int, members: list[_Request]) -> None:
        """One group's all-reduce: every member gets the encoded average (or, in a round that fails mid-way, a mix
        of it and its own parts) TRANSFER seconds later."""
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
               "after": {}, "stops": {m.region: m.stop for m in members}, "decided": {},
               "weights": {m.region: m.weight for m in members}}
        self.out.rounds.append(log)
        for m in members:
            averaged, consistent = results[m.region]
            self._at(self.now + TRANSFER, lambda m=m, a=averaged, c=consistent, g=len(members):
                     self._resume(m.process, m.region, m.incarnation, (a, c, g, log)))
