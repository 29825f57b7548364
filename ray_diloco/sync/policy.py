"""The outer-sync protocol as pure functions: who is in a round, which state is canonical, when to re-sync,
when to stop. No Ray, no Hivemind: the SyncActor reads the records, asks here, and carries the answer out
(STYLE.md §3), and `tests/protocol_sim.py` drives the same functions through thousands of random schedules.

A region's life, as the SyncActor runs it with these functions:
1. join: `join_target` — a region starting (fresh, resumed, late) takes the others' canonical state if ahead
   (from `startup_records`: never what a region its own driver starts now stored in an earlier life); a driver
   resuming its regions starts them from the checkpoints `choose_resume_steps` picks;
2. each round, `Rendezvous` (a state machine: records in, one action out — publish our phase, load a state,
   sleep, or end with Run or Finish), deciding with `plan_round`;
3. after the last round, `Settling` (deciding with `settle_at_end`), then FINISHED (or UNSETTLED, where it could
   not check its state): the region never changes its state again;
4. a round with a non-finite Δ: the region sits it out (OUT) and, with `Resync`, takes `newer_state`, or stops.
Around each round: `round_arrival` (where the others' deadline counts from), `may_overlap` (whether it runs while
the workers train on), `published_group` (the vote its new state carries), `checkpoints_at` (whether the workers
and the SyncActor checkpoint it), `commits_hand_in_checkpoint` (whether the checkpoint the workers saved as they
handed in under a preemption notice is committed with the round's state), and, in `overdue.py` (re-exported
here), `overdue_round` for a blocking round still running at its `round_bound` (a hung DHT call: finish it in the
background, abandon it, or fail the workers), and `overdue_in_flight` for a round still running when the next one
has waited that bound for it (abandon it, or fail). Every load is bounded by `download_seconds` (the state's size
at the slowest allowed link). The SyncActor and the simulator (`tests/protocol_sim.py`) call these same functions.

Records. Every region publishes one `StateRecord` in the DHT: its outer step, the digest of its θ_global, the
size of the group whose round produced that state, and its phase in the round at that step (training, ready to
average, sitting it out, finished). A region that died stops refreshing its record and drops out when it
expires. A region's driver may end before the others (one Ray cluster per region), so each region also keeps its
record in the run's storage (`ray_diloco.sync.durable`); `with_stored` adds the stored record of every region
that has no live one, so a finished region's final state is still seen (and loaded) after its driver is gone.

Canonical state. `choose_canonical` is a function of the records alone, and a region votes with exactly the
record it published, so every region that reads the same records picks the same state (a region voting with
another group size than it published made two diverged regions swap states every round, forever).

Rendezvous (why readiness records). Hivemind's matchmaking forms a group from the peers that ask within one
window; a region steadily slower than that window went alone every round and the other leapfrogged it for the
rest of the run. A longer window would make every round wait its full length whenever a region is gone. So a
region that is ready says so in its record, and `plan_round` waits for exactly the live regions that are not
ready yet, up to `max_wait_seconds` after the earliest ready region's workers came in (its own, or an earlier
one among the records: every ready region reads the same records and so runs at about the same moment with
the same group), then asks Hivemind for a group of the ready ones, which fills at once. Skew up to
`max_wait_seconds` costs only the skew; a dead region costs at most its record's lifetime; nothing waits
without a bound. (An adaptive deadline from observed lags was the other option: it needs history, still
guesses, and a region that joins or slows down breaks its estimate.) Reads can differ: a DHT read may miss a
record just stored (a region that has just joined). A ready region that does not see it runs without it, while
one that does waits for it; the first goes alone (its group does not fill) and the second, seeing the newer
state, adopts it and averages its Δ in the next round instead: it has no round at that step, and the two stay
one (the simulator's partial views).

No shared clock. Regions run on hosts whose clocks differ (by minutes, and drifting), so a record carries no
time of day: a ready region publishes how long it has waited (`waited`, measured on its own monotonic clock)
and publishes it again while it waits, and a reader places that moment on its own clock as `now - waited`. A
record read some time after it was published gives a later moment than the true one, so the reader keeps the
earliest estimate it has seen (`ready_times`): one read soon after a republish pins it within about a second,
and a record that is no longer republished (its region is averaging) does not push the deadline back. Ready
regions so run within about a second of each other, well inside the matchmaking window. Every time `plan_round`
compares is on the calling region's monotonic clock.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass

# A round that does not end: decided in overdue.py, part of this module's decisions (callers use policy.*)
from ray_diloco.sync.overdue import (  # noqa: F401
    ABANDON,
    ABANDONED_ROUNDS_LIMIT,
    FAIL,
    FINISH_IN_BACKGROUND,
    overdue_in_flight,
    overdue_round,
    round_bound,
)

TRAINING = "training"  # its workers are on their inner steps towards the round at `outer_step`
READY = "ready"  # its workers' shards are in: it waits to average the round at `outer_step`
OUT = "out"  # it sits the round at `outer_step` out (a non-finite Δ): nobody waits for it
FINISHED = "finished"  # it ended the run with this state and will not change it again
# It ended the run without checking its state against the others' (its DHT did not answer, or the final state
# could not be loaded, in time): done, but not a final state the others take (it would compete with a settled one).
UNSETTLED = "unsettled"
PHASES = (TRAINING, READY, OUT, FINISHED, UNSETTLED)


@dataclass(frozen=True)
class StateRecord:
    region: str
    outer_step: int  # outer steps applied to the published state
    digest: str  # state_digest(θ_global)
    group_size: int  # regions in the round that produced it (0: initial or adopted, 1: alone or failed mid-round)
    phase: str = TRAINING
    waited: float = 0.0  # READY: seconds since its workers came in, on its own clock, when it published this
    # state_digest(momentum): a download checks the momentum against it too ("": not published, not checked)
    momentum_digest: str = ""


def parse_record(region: str, value: dict) -> StateRecord:
    """A region's record from its published mapping (the DHT value, or the copy in the SyncActor's stats).
    Raises ValueError (or TypeError, KeyError) on a malformed one; an unknown phase counts as TRAINING."""
    phase = str(value.get("phase", TRAINING))
    return StateRecord(str(region), int(value["outer_step"]), str(value["digest"]), int(value["group_size"]),
                       phase if phase in PHASES else TRAINING, float(value.get("waited", 0.0)),
                       str(value.get("momentum_digest", "")))


def with_stored(live: list[StateRecord] | None, stored: list[StateRecord]) -> list[StateRecord] | None:
    """The records a region decides from: the live ones (the DHT's) and, for each region without a live record,
    the one it kept in the run's storage (`ray_diloco.sync.durable`: its driver may be gone, and its DHT record
    with it). A live record wins: it is newer. None (the DHT did not answer) stays None if storage has none."""
    if live is None and not stored:
        return None
    regions = {r.region for r in live or []}
    return list(live or []) + [r for r in stored if r.region not in regions]


def choose_canonical(records: list[StateRecord]) -> StateRecord | None:
    """The state every region should hold: highest outer_step; then the state (θ_global's digest with the
    momentum's) held by the most regions; then the largest group_size; then the smallest digests. Of the winning
    state's records: largest group, then region. (A record naming the majority's θ_global beside a momentum of its
    own is a state of its own: it cannot lend its momentum to the majority's θ.)"""
    if not records:
        return None
    top = max(r.outer_step for r in records)
    by_state: dict[tuple[str, str], list[StateRecord]] = defaultdict(list)
    for record in records:
        if record.outer_step == top:
            by_state[(record.digest, record.momentum_digest)].append(record)
    state = min(by_state, key=lambda d: (-len({r.region for r in by_state[d]}),
                                         -max(r.group_size for r in by_state[d]), d))
    return min(by_state[state], key=lambda r: (-r.group_size, r.region))


def needs_resync(own: StateRecord, records: list[StateRecord]) -> StateRecord | None:
    """The canonical record if `own` differs from it, else None. `own` (the record as published) replaces its
    region's entry among `records`; a canonical state is never at a lower step than `own`."""
    canonical = choose_canonical([r for r in records if r.region != own.region] + [own])
    return None if canonical is None or canonical.digest == own.digest else canonical


# -- decisions --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """Average now with `expected` regions (this one included); `absent`: live regions not ready in time;
    `gave_up`: the state it stopped trying to load (its give-up time passed), if that is why it runs alone."""
    expected: int
    absent: tuple[str, ...] = ()
    gave_up: StateRecord | None = None


@dataclass(frozen=True)
class Adopt:
    """Load this peer's state first (ours is behind or lost the canonical vote), then ask again. From the state
    machines (`Rendezvous`, `Settling`): load it (and publish it if that worked), report the outcome with
    `loaded`."""
    record: StateRecord


@dataclass(frozen=True)
class Wait:
    """Read the records again soon; give up waiting at `deadline`."""
    deadline: float
    waiting_on: tuple[str, ...] = ()


@dataclass(frozen=True)
class Finish:
    """The run's last outer step is reached: no round (a round now would overshoot past it). settled=False: the
    region could not read the others' records before its deadline, so it ends unchecked (and says so)."""
    settled: bool = True


Decision = Run | Adopt | Wait | Finish


def ready_times(seen: dict[tuple[str, int], float], records: list[StateRecord] | None,
                now: float) -> dict[tuple[str, int], float]:
    """When each ready region became ready for its round, on the reader's clock: (region, outer step) -> the
    earliest `now - waited` read so far (a later read of a record gives a later estimate, never an earlier one)."""
    times = dict(seen)
    for r in records or []:
        if r.phase == READY:
            key = (r.region, r.outer_step)
            times[key] = min(times.get(key, math.inf), now - r.waited)
    return times


def plan_round(own: StateRecord, records: list[StateRecord] | None, *, target: int, arrived: float,
               now: float, max_wait: float, fallback_expected: int,
               ready_at: dict[tuple[str, int], float] | None = None) -> Decision:
    """What a region whose workers' shards are all in (since `arrived`) does next.

    records: the live records (ours among them or not), None if the DHT did not answer; then the region waits
    for it until `arrived + max_wait` and averages with `fallback_expected` regions after that (the SyncActor
    passes 1: with the DHT unreadable nobody could have seen it ready, so it goes alone).
    `arrived` and `now` are on this region's own monotonic clock; other regions' readiness is placed on it by
    `ready_at` (`ready_times`), else from their `waited` as read now (see "No shared clock").
    """
    if own.outer_step >= target:  # first: even with the DHT unreadable, never a round past the last step
        return Finish()
    if records is None:
        deadline = arrived + max_wait
        return Wait(deadline) if now < deadline else Run(fallback_expected)
    canonical = needs_resync(own, records)
    if canonical is not None:
        return Adopt(canonical)
    others = [r for r in records if r.region != own.region]
    ready = [r for r in others if r.outer_step == own.outer_step and r.phase == READY]
    # One deadline per round, the earliest ready region's: every ready region reads the same records, so all of
    # them run at the same moment with the same group (each at its own deadline, the first would run while the
    # others still wait for a straggler, and its group would never fill).
    ready_at = ready_at or {}
    deadline = min([arrived] + [ready_at.get((r.region, r.outer_step), now - r.waited) for r in ready]) + max_wait
    waiting_on = tuple(sorted(r.region for r in others
                              if not (r.outer_step == own.outer_step and r.phase in (READY, OUT))))
    if not waiting_on:
        return Run(1 + len(ready))
    if now >= deadline:
        return Run(1 + len(ready), absent=waiting_on)
    return Wait(deadline, waiting_on)


# -- one region's rendezvous, as a state machine (the SyncActor and tests/protocol_sim.py both run it) --------
@dataclass(frozen=True)
class Publish:
    """Publish our record with `phase` (READY: having waited `waited` seconds), then ask again at once."""
    phase: str
    waited: float = 0.0


@dataclass(frozen=True)
class Sleep:
    """Read the records again after `seconds`."""
    seconds: float


class Rendezvous:
    """What a region whose workers' shards are in does until it averages or finishes: `next` takes what the region
    reads now (its published record, the records, its monotonic clock) and returns one action, Publish, Adopt
    (load that state), Sleep, or the end: Run or Finish. The caller carries the action out and asks again. No I/O here: the
    SyncActor (`Membership._rendezvous`) and the simulator drive the same machine.

    Rules: `plan_round` decides. A region says it is ready once it holds the state it will average from, and says
    again how long it has waited every `republish` seconds while it waits (the others place its readiness on their
    clocks from it); it withdraws readiness before it loads a newer state. A load that failed is retried after
    `poll`. Past `give_up` (the round's deadline plus one download) it loads nothing more — a state that cannot
    be loaded, or one that moves on faster than it loads — and averages alone (the next round re-syncs).
    `plan` and `chase_bound` exist so the tests can run the old rules."""

    def __init__(self, *, target: int, arrived: float, max_wait: float, give_up: float, poll: float,
                 republish: float, plan=None, chase_bound: bool = True):
        self.target, self.arrived, self.max_wait, self.give_up = target, arrived, max_wait, give_up
        self.poll, self.republish, self.chase_bound = poll, republish, chase_bound
        self.plan = plan or plan_round
        self.said_ready: float | None = None  # when we last published READY; None while not ready
        self.ready_at: dict[tuple[str, int], float] = {}  # the others' readiness on our clock (ready_times)
        self.last_load_ok = True
        self.sleep_first = False  # the last load failed: wait a poll before the next attempt

    def loaded(self, ok: bool) -> None:
        self.last_load_ok, self.sleep_first = ok, not ok

    def next(self, own: StateRecord, records: list[StateRecord] | None,
             now: float) -> Run | Finish | Publish | Adopt | Sleep:
        self.ready_at = ready_times(self.ready_at, records, now)
        decision = self.plan(own, records, target=self.target, arrived=self.arrived, now=now, max_wait=self.max_wait,
                             fallback_expected=1,  # the DHT is unreadable: nobody could see us ready either
                             ready_at=self.ready_at)
        if isinstance(decision, Adopt):
            if now > self.give_up and (self.chase_bound or not self.last_load_ok):
                return Run(1, gave_up=decision.record)
            if self.said_ready is not None:
                self.said_ready = None
                return Publish(TRAINING)
            if self.sleep_first:
                self.sleep_first = False
                return Sleep(self.poll)
            return decision
        if isinstance(decision, Finish):
            return decision
        if self.said_ready is None or (isinstance(decision, Wait) and now - self.said_ready >= self.republish):
            self.said_ready = now
            return Publish(READY, waited=now - self.arrived)
        if isinstance(decision, Wait):
            return Sleep(max(0.0, min(self.poll, decision.deadline - now)))
        return decision


def settle_at_end(own: StateRecord, records: list[StateRecord] | None, *, target: int, ended: float,
                  now: float, max_wait: float) -> Adopt | Wait | Finish:
    """After a region's last round: wait (until `ended + max_wait`) for every live region to reach `target`,
    then take the canonical state, so that every region that finishes holds the same θ_global even when the
    last round failed mid-way or went without some region. The state of a region that already finished wins:
    it can no longer change, so a region that reaches the end later (it waited out a DHT outage) takes it."""
    deadline = ended + max_wait
    if records is None:
        return Wait(deadline) if now < deadline else Finish(settled=False)
    others = [r for r in records if r.region != own.region]
    if not any(r.phase == FINISHED for r in others):
        behind = tuple(sorted(r.region for r in others if r.outer_step < target))
        if behind and now < deadline:
            return Wait(deadline, behind)
    final = final_state([r for r in others if r.outer_step >= target] + [own])
    return Adopt(final) if final.digest != own.digest else Finish()


class Settling:
    """After a region's last round, until it finishes (publishes FINISHED and keeps its final state): `next`
    returns Adopt (load that state), Sleep, or Finish (settled=False: it ends unchecked and says so), deciding with `settle_at_end`.
    A state that cannot be loaded is tried until `give_up` (max_wait plus one download after the end). The
    SyncActor (`Membership._settle_at_end`) and the simulator drive the same machine."""

    def __init__(self, *, target: int, ended: float, max_wait: float, give_up: float, poll: float,
                 settle=None):
        self.target, self.ended, self.max_wait, self.give_up, self.poll = target, ended, max_wait, give_up, poll
        self.settle = settle or settle_at_end
        self.load_failed = False

    def loaded(self, ok: bool) -> None:
        self.load_failed = not ok

    def next(self, own: StateRecord, records: list[StateRecord] | None, now: float) -> Adopt | Sleep | Finish:
        if self.load_failed:
            self.load_failed = False
            return Finish(settled=False) if now > self.give_up else Sleep(self.poll)
        decision = self.settle(own, records, target=self.target, ended=self.ended, now=now, max_wait=self.max_wait)
        if isinstance(decision, Adopt):
            return decision
        if isinstance(decision, Finish):
            return decision
        return Finish(settled=False) if now > self.give_up else Sleep(max(0.0, min(self.poll, decision.deadline - now)))


@dataclass(frozen=True)
class Stop:
    """The region cannot go on (a non-finite Δ and no newer state to take): it ends with this error."""
    why: str


class Resync:
    """A region whose Δ was non-finite sits the round out (its record says OUT: nobody waits for it) until it holds
    a newer state: `next` returns Adopt (the canonical state past its step: load it, report with `loaded`), Sleep,
    or Stop once `give_up` passed with none loaded — the others may wait up to max_wait for stragglers before
    their round and a load takes up to one download, so the SyncActor gives it that long. The SyncActor
    (`Membership._resync_from_newer`) and the simulator drive the same machine."""

    def __init__(self, *, own_step: int, region: str, give_up: float, poll: float):
        self.own_step, self.region, self.give_up, self.poll = own_step, region, give_up, poll
        self.load_failed = False

    def loaded(self, ok: bool) -> None:
        self.load_failed = not ok

    def next(self, records: list[StateRecord] | None, now: float) -> Adopt | Sleep | Stop:
        """After a failed load, `records` are not read (the caller may pass None): a poll passes first."""
        newer = None if self.load_failed else newer_state(self.own_step, self.region, records or [])
        self.load_failed = False
        if newer is not None:
            return Adopt(newer)
        if now >= self.give_up:
            return Stop(f"no other region published a state past outer step {self.own_step} that could be loaded "
                        "in time")
        return Sleep(self.poll)


# -- the rest of a round: checkpoints, overlap, the deadline's origin, the published group ---------------------
def checkpoints_at(reached: int, every: int, stopping: bool, advanced: bool = True, notice: bool = False) -> bool:
    """Whether a region checkpoints the state of outer step `reached` (run.checkpoint_every; 0: never): every
    `every` steps, wherever the run stops (started again, it continues from there), and every round while a
    preemption notice stands (`notice`: the group Ray Train starts after the deadline continues from the last
    round, AdamW included; see ray_diloco/preemption.py). Not again after a round that did not advance
    (`advanced`: an abandoned round's step was checkpointed when it was due), except where the run stops or a
    notice stands: the newer AdamW state is what the group that follows should continue from. The workers and the
    SyncActor both ask here."""
    return stopping or notice or bool(advanced and every and reached % every == 0)


def commits_hand_in_checkpoint(round_from: int | None, reached: int, overlapped: bool = False,
                               in_background: bool = False) -> bool:
    """Whether the SyncActor commits, with the state a region's round reached, the worker checkpoint its workers saved
    as they handed in under a preemption notice (ray_diloco/preemption.py): wherever that round, run blocking from
    outer step `round_from` (None: it ran none, an overlapped round in flight having agreed to stop), moved the
    region on, by one step or, re-synced, to a later one, since the checkpoint's AdamW state is the one the workers
    go on with from either (its loader aligns the schedule to the step reached, as they do). The SyncActor commits
    it as the round ends, whether or not the group is still there to see it: a round that meets the other regions
    after the deadline keeps the inner state. Not after an abandoned round (`reached == round_from`), nor for one
    finishing in the background (`in_background`: it has applied its step but not yet counted its tokens and data
    position), nor for one that overlapped (its state is not θ_global itself; one under a notice blocks,
    `may_overlap`): the workers checkpoint after those as ever (`checkpoints_at`). The SyncActor and the simulator
    ask here; the workers ask the SyncActor what it committed."""
    return round_from is not None and not overlapped and not in_background and reached > round_from


def stops_after_round(asked: bool, members: list, own_driver: frozenset[str], asked_since: bool = False) -> bool:
    """Whether a region ends its run after a round on a stop request (`ray job stop`, SIGTERM): where it had
    asked when it handed in its Δ (`asked`, in the round's gather), or a member of its group run by the same
    driver (a region of `own_driver`) had. Every member of a group gets the same gather, so the regions of one
    driver that averaged together stop at the same outer step. Deciding on the flag as the round ended instead,
    a stop that reached one region's SyncActor just before the round ended and the other's just after split
    them: one ran a round more, alone, after waiting outer.max_wait_seconds for the other, and the run no longer
    continued to the model of an uninterrupted one. A request that comes after the hand-in ends the next round,
    except for a region alone in its driver (`asked_since`: asked by the round's end), which nobody can split
    from. `members`: the peers' gathers, checked here (a region named by a string, claimed once; a flag True)."""
    if len(own_driver) <= 1:
        return asked or asked_since
    gathers = [m for m in members if isinstance(m, dict) and isinstance(m.get("region"), str)]
    claims = Counter(m["region"] for m in gathers)  # a region claimed twice: neither claim counts
    return asked or any(m.get("stop") is True and m["region"] in own_driver and claims[m["region"]] == 1
                        for m in gathers)


def may_overlap(*, overlap: bool, reached: int, target: int, checkpoint_every: int, stopping: bool,
                finite: bool, notice: bool = False) -> bool:
    """Whether the round that reaches outer step `reached` may run while the workers train on (outer.overlap):
    not the run's last round (the workers end on the final state), nor a checkpointed one (the checkpoint holds
    the state after the round), nor one with a non-finite Δ (the region then takes another region's state,
    which its workers must take as it is)."""
    return (overlap and finite and reached < target
            and not checkpoints_at(reached, checkpoint_every, stopping, notice=notice))


def round_arrival(now: float, last_round_ended: float, window: float) -> float:
    """Where the others' deadline for a round counts from: when the region would be in had its last round blocked
    — that round's end plus the window its workers just trained (= now, without overlap). From its actual arrival,
    an overlapped region (a window ahead) would leave a region slower by less than max_wait out of rounds (found by
    the protocol property tests)."""
    return max(now, last_round_ended + window)


def published_group(group_size: int, consistent: bool) -> int:
    """The group size a region publishes with the state a round produced: a round that failed mid-way left each
    member a mix of averaged and own parts, so its state is a weak vote (`choose_canonical`): one."""
    return group_size if consistent else 1


def final_state(records: list[StateRecord]) -> StateRecord | None:
    """The state a run ends with: that of the regions that already finished (it can no longer change, so
    whoever comes later takes it), else the canonical one. The driver exports the same."""
    return choose_canonical([r for r in records if r.phase == FINISHED]) or choose_canonical(records)


def download_seconds(state_bytes: int, mbps: float, at_least: float) -> float:
    """How long loading a state of `state_bytes` may take: its size at `mbps` Mbit/s, never less than `at_least`."""
    return max(at_least, 8.0 * state_bytes / (mbps * 1e6))


def choose_resume_steps(committed: dict[str, list[int]], interval: int = 1) -> dict[str, int | None]:
    """The outer checkpoint each region resumes from. The regions still in the run are those whose newest
    checkpoint is within one checkpoint `interval` of the newest of all (a stop lands between two regions'
    commits at most that far apart; a region that left early holds only old steps). They resume together from
    the newest step all of them hold, so none re-trains windows already averaged into θ_global; a region
    not in that step (it left early) resumes from its own newest checkpoint before it and catches up from its
    peers' state, as a joining region does (`startup_records`, `join_target`). Where they hold no step in
    common, the step is the oldest of their newest ones. A region that holds only steps after it (stopped
    apart with `checkpoint_every` > 1: {a: [1], b: [2]}) resumes from its oldest: the others then take its
    state, and re-train the windows between their step and its, if they took part in those rounds (a fresh
    start would have read its whole stream again)."""
    newest = {region: max(steps) for region, steps in committed.items() if steps}
    if not newest:
        return {region: None for region in committed}
    top = max(newest.values())
    staying = [region for region, step in newest.items() if step >= top - max(1, interval)]
    common = set.intersection(*(set(committed[region]) for region in staying))
    target = max(common) if common else min(newest[region] for region in staying)
    return {region: max((s for s in steps if s <= target), default=min(steps, default=None))
            for region, steps in committed.items()}


def startup_records(live: list[StateRecord] | None, stored: list[StateRecord],
                    started_here: set[str]) -> list[StateRecord] | None:
    """What a region starting up decides its join from: `with_stored`, less the stored records of the regions
    its driver starts now (`started_here`: resumed at the driver's plan, or fresh). Those are their own previous
    life's: a killed run's region that had committed one step more than the others left a record ahead of the
    step they all resume from, and the first region started took that state — skipping a round whose windows it
    then trained again."""
    return with_stored(live, [record for record in stored if record.region not in started_here])


def join_target(own: StateRecord, records: list[StateRecord]) -> StateRecord | None:
    """A region starting (fresh, resumed from an older checkpoint, or late): the canonical state of the others
    if it is ahead of ours. Never a lower step: a region resumed ahead of a stale peer keeps its own."""
    canonical = choose_canonical([r for r in records if r.region != own.region])
    return canonical if canonical is not None and canonical.outer_step > own.outer_step else None


def newer_state(own_step: int, region: str, records: list[StateRecord]) -> StateRecord | None:
    """A region that sat a round out (non-finite Δ) takes the canonical state of those past its step."""
    return choose_canonical([r for r in records if r.region != region and r.outer_step > own_step])
