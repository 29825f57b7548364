"""What the protocol simulator (`tests/protocol_sim.py`) runs and checks: a schedule of regions (`Schedule`,
`RegionPlan`: window times, faults, clocks), the rules the simulated SyncActor follows (`Rules`: today's code by
default, the old rules for the fault-finding tests), what a run produced (`Outcome`), and the invariants it must
keep (`violations`). The simulator itself is the event loop, the DHT, the averager and the regions.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from ray_diloco.sync import policy
from ray_diloco.sync.outer import OuterOptimizer, state_digest
from ray_diloco.sync.policy import StateRecord

POLL = 0.5  # as ray_diloco.sync.membership.POLL_SECONDS
REPUBLISH = 1.0  # as ray_diloco.sync.membership.REPUBLISH_SECONDS
TRANSFER = 0.2  # seconds an all-reduce of the tiny tensors takes once the group formed
COMPRESSION = "scaled-fp16"


def default_outer_step(outer: OuterOptimizer, averaged: dict, cpu: str) -> None:
    outer.step(averaged)


@dataclass(frozen=True)
class Rules:
    plan_round: Callable = policy.plan_round
    settle_at_end: Callable | None = policy.settle_at_end  # None: a region ends right after its last round
    vote: Callable[[_Region], StateRecord] = lambda region: region.published  # the record a region votes with
    publish_adoption: bool = True  # a region that adopted a state publishes it at once
    atomic_handshake: bool = True  # a restarted group's state is taken after the round in flight
    check_exchange_step: bool = True  # exchange refuses shards trained from another outer step
    dht_errors_fatal: bool = False  # a DHT read that fails ends the region
    outer_step: Callable[[OuterOptimizer, dict, str], None] = default_outer_step
    blocking_time_deadline: bool = True  # overlap: the deadline counts from when the region would be in if blocking
    wall_clock_ready: bool = False  # (before issue 22) a record carried the wall-clock time its region was ready
    stored_finals: bool = True  # a finished region's final state stays in the run's storage (sync/durable.py)
    chase_bound: bool = True  # a rendezvous stops re-syncing at its give-up time even while adoptions succeed
    abandon_hung_rounds: bool = True  # (the actor before d8d263f) a hung round failed the group (Ray Train)
    # (the actor before this was found) an overlapped round abandoned at the next round was not counted in a row
    count_overlapped_hangs: bool = True
    # (the actor before 534286f) a region stopped on its own request as its round ended, not on its group's
    agreed_stop: bool = True
    # (the workers before 70aebf1) a preemption notice was looked for once a round, never mid-window
    looks_mid_window: bool = True
    # (the workers before c0395b8, who had no mid-window looks either) that look came before the exchange, blocking
    # rounds too: a notice that came while the workers waited in a round was seen only in the next window, so they
    # trained on instead of waiting for the deadline on that round's checkpoint
    looks_after_round: bool = True
    # A mutation, not an old rule (the workers have told the SyncActor of a notice since 0539e53): an overlapped round
    # under a notice, which cannot be checkpointed, as the property tests must catch
    notice_blocks: bool = True
    # (the workers before the hand-in checkpoint) under a notice they told, they saved their part after the round
    # only: a round that met the other regions after the deadline left the next group to start AdamW anew
    checkpoint_at_hand_in: bool = True
    # (the workers before worker.wait_for_round) they did not look for a notice while they waited in a round: one that
    # came then, with the round ending after its deadline, left no checkpoint of the round's step
    looks_in_round: bool = True
    # (the workers before this rule) a notice a mid-window look found, the window trained on in full (there was time
    # for it and its round): without overlap they told the SyncActor nothing with their hand-in and saved their part
    # at the first look in the round, ROUND_LOOK_SECONDS later; a round that outlasted its estimate and the deadline
    # before that look left no checkpoint of the round's step
    tells_a_known_notice: bool = True
    # (the workers before preemption.LOOK_SECONDS) their mid-window looks were a ninth of a window apart however slow
    # its steps: a notice shorter than that (a window of 3.4 s steps in CI: 24 s) could come and go between two
    looks_by_time: bool = True
    # (the workers before preemption.TIMED_STEP) a group's first window had no step time for its looks: a ninth of the
    # window apart, a notice shorter than that could come and go between two (a restarted group's first window)
    times_first_window: bool = True


@dataclass(frozen=True)
class RegionPlan:
    name: str
    window_seconds: float  # H inner steps
    jitter: tuple[float, ...] = ()  # extra seconds of window w: jitter[w % len]
    start_at: float = 0.0
    depart_at: float | None = None  # gone for good
    crash_at: float | None = None  # actor and workers die; back `downtime` later from the last checkpoint
    restarts: tuple[float, ...] = ()  # the worker group restarts (Ray Train) at these times
    dht_down: tuple[tuple[float, float], ...] = ()  # intervals in which this region's DHT calls fail
    # intervals in which its DHT reads answer with part of the records, some in an older version (the nodes that
    # hold the others' newest values unreachable, or not yet reached by a store)
    partial_views: tuple[tuple[float, float], ...] = ()
    cpu: str = "default"  # the kernel path of the host of its SyncActor
    clock_offset: float = 0.0  # its host's clock reads clock_offset + (1 + clock_drift) * simulated time
    clock_drift: float = 0.0
    stop_at: float | None = None  # its driver is asked to stop (`ray job stop`): it ends after the round, checkpointed
    resubmit_after: float | None = None  # ... and is submitted again this much later (None: never), continuing
    driver: str | None = None  # the driver (one Ray cluster) that runs it with others of that name; None: its own
    # Preemption notices: (when a node of its group is drained, seconds until the deadline; None: the drain states
    # none, and Ray Train ends the group preemption.UNSTATED_DEADLINE_SECONDS after it). Ray Train tells the
    # workers, ends the group at the deadline and starts another (protocol_notices.py).
    notices: tuple[tuple[float, float | None], ...] = ()


@dataclass(frozen=True)
class Schedule:
    regions: tuple[RegionPlan, ...]
    target: int = 4  # run.outer_steps
    failing_steps: frozenset[int] = frozenset()  # outer steps whose group round fails mid-way (once)
    max_wait: float = 30.0
    matchmaking: float = 5.0
    ttl: float = 20.0
    downtime: float = 15.0
    restart_seconds: float = 2.0
    overlap: bool = False  # outer.overlap: a round runs while the workers train the next window
    averaging_timeout: float = 10.0  # a settling region gives up loading a state max_wait + this after its end
    download: float = 0.0  # seconds a state download takes (a holder that died or moved on meanwhile fails it)
    leave_after_finish: float | None = None  # a finished region's driver exits then: its DHT record and server go
    checkpoint_every: int = 1  # run.checkpoint_every: a crash resumes from the last multiple (and replays since)
    nonfinite: frozenset[tuple[str, int]] = frozenset()  # (region, data window) whose Δ is NaN/inf (each time it is trained)
    # (region, data window) whose round hangs, once: its Hivemind node stops answering (a DHT call that never
    # returns; its record is no longer refreshed) until the round is given up at `policy.round_bound` (a blocking
    # round), or the next round has waited that long for it (an overlapped one)
    hangs: frozenset[tuple[str, int]] = frozenset()
    # (region, data window) whose blocking round hangs, once, right after its outer step (the store of its new
    # record never returns): the round finishes in the background and the next round abandons it. Not the run's
    # last round (a hang in the settling after it is not modelled).
    hangs_after_step: frozenset[tuple[str, int]] = frozenset()
    max_failures: int = 1  # run.max_failures: a region whose group failed more often leaves the run
    split_steps: frozenset[int] = frozenset()  # outer steps whose round forms two groups (once): every other member
    inner_steps: int = 50  # H: a window's inner steps, where the mid-window looks for a notice fall


@dataclass
class _Region:
    plan: RegionPlan
    outer: OuterOptimizer
    digest: str
    progress: int = 0  # the next data window
    published: StateRecord | None = None
    incarnation: int = 0
    # Carried from one window to the next (protocol_sim._region): the old handshake's stale base (a group restarted
    # during a round took the state of before it); with overlap, (the θ the workers train from, when they
    # started) after an overlapped round; the end of the region's last round (or its group's restart).
    stale_base: tuple | None = None
    overlapped: tuple | None = None
    round_ended: float = 0.0
    abandoned_in_a_row: int = 0  # the SyncActor's count (`policy.overdue_round`); a group restart keeps it
    hung_node: tuple | None = None  # while its Hivemind node hangs: (the state it no longer serves,)
    # What the simulator saw (not the actor's count): rounds abandoned in a row with no round ended nor group failed
    seen_abandoned: int = 0
    last_round_seconds: float | None = None  # the SyncActor's last round as it timed it (None: it ran none yet)
    last_exchange_seconds: float | None = None  # the workers' last exchange call (None: none yet)
    last_window_seconds: float = 0.0  # the last window's time for H inner steps
    worker_checkpoint: int | None = None  # the outer step of the newest worker checkpoint (inner AdamW state)
    group_started: float = 0.0  # when its worker group (Ray Train's) last started
    # (group_started of the group that trained it, seconds per inner step) of the last window: a group's workers space
    # their mid-window looks by their own last window (preemption.looks_within_window); their first, by its
    # TIMED_STEP (preemption.first_window_looks)
    step_timing: tuple[float, float] | None = None
    looks: list[float] = field(default_factory=list)  # when the group's workers looked for a notice (and its start)


@dataclass
class Outcome:
    finished: dict[str, tuple[int, str]] = field(default_factory=dict)  # region -> (step, digest) when it ended
    rounds: list[dict] = field(default_factory=list)  # every group the averager formed
    violations: list[str] = field(default_factory=list)  # broken invariants seen while running
    windows: dict[str, list[int]] = field(default_factory=dict)  # data windows whose round completed, in order
    gone: set[str] = field(default_factory=set)  # departed for good
    dead: dict[str, str] = field(default_factory=dict)  # region -> why it ended without finishing
    unsettled: set[str] = field(default_factory=set)  # ended without reading the others' records (DHT down)
    ready: list[tuple[int, str, float]] = field(default_factory=list)  # (outer step, region, when it was ready)
    stopped: dict[str, str] = field(default_factory=dict)  # region -> why it stopped with an error (Resync's Stop)
    sat_out: list[tuple[str, int]] = field(default_factory=list)  # (region, its step) of each non-finite round
    replayed: dict[str, int] = field(default_factory=dict)  # region -> windows trained again after a crash
    stops: list[tuple[str, int]] = field(default_factory=list)  # (region, the step it stopped at, checkpointed)
    # (region, the step its driver resumed it from, its newest checkpoint's step) at each resubmit
    resubmits: list[tuple[str, int | None, int | None]] = field(default_factory=list)
    abandoned: list[tuple[str, int]] = field(default_factory=list)  # (region, its step) of each abandoned round
    abandoned_in_flight: list[tuple[str, int]] = field(default_factory=list)  # ... of those, abandoned in flight
    finished_in_background: list[tuple[str, int]] = field(default_factory=list)  # (region, the step it applied)
    abandoned_by_restart: list[tuple[str, int]] = field(default_factory=list)  # ... in flight, by a restarted group
    failures: dict[str, int] = field(default_factory=dict)  # region -> its group's failures (Ray Train restarts)
    splits: list[int] = field(default_factory=list)  # outer steps whose round formed two groups
    partial_reads: int = 0  # records a read missed or saw in an older version (RegionPlan.partial_views)
    early: list[tuple[str, int, int]] = field(default_factory=list)  # (region, window, inner steps) ended early
    # (region, deadline, what the group that Ray Train ended there left): "kept" (it waited on a checkpoint of the
    # step the next group starts from), "cut off" (it was mid-window), "outlived" (its round ended after it, so no
    # checkpoint of the round's step: the next group starts AdamW anew; "outlived early": the round of a window ended
    # early), "lost" (it waited with no checkpoint), "restarting" (a group that had trained nothing yet)
    deadlines: list[tuple[str, float, str]] = field(default_factory=list)
    # (region, when, the step of the round) of each of the schedule's restarts that came while the workers were in a
    # round: no checkpoint of that step
    restarted_in_round: list[tuple[str, float, int]] = field(default_factory=list)
    # (region, when) a group under an unstated deadline, Ray Train's later than the workers', woke from its wait
    # (preemption.NOTICE_GRACE_SECONDS after their deadline) and trained on
    woke_before_deadline: list[tuple[str, float]] = field(default_factory=list)
    blocking_rounds: list[tuple[str, float, float]] = field(default_factory=list)  # (region, hand-in, end) of each
    # (region, hand-in) of each round handed in under a notice an earlier look of its group had found
    known_at_hand_in: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class _Request:
    region: str
    step: int
    delta: dict
    weight: float
    expected: int
    state_key: tuple  # (step, θ digest, momentum digest) when it asked
    process: object
    incarnation: int
    stop: bool = False  # a stop asked of the region when it handed its Δ in: in the round's gather


def initial_theta() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 2, generator=g), "b": torch.randn(4, generator=g)}


def window_update(region: str, window: int, like: dict) -> dict[str, torch.Tensor]:
    """What H inner steps on data window `window` of `region` do to θ (fixed, so replays are exact)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{region}/{window}".encode()))
    return {name: 1e-2 * torch.randn(t.shape, generator=g) for name, t in like.items()}


def full_key(outer: OuterOptimizer) -> tuple:
    return outer.step_count, state_digest(outer.global_state()), state_digest(outer.momentum_state())


def violations(schedule: Schedule, out: Outcome) -> list[str]:
    """Every invariant of the protocol issue that this run broke (empty: all held)."""
    found = list(out.violations)
    # A region whose DHT was down through its whole settling time cannot know the canonical state: it says so
    # (event unsettled_at_end; the driver's summary lists disagreeing regions and exports the canonical state).
    finals = {state for name, state in out.finished.items() if name not in out.unsettled}
    if len(finals) > 1:
        found.append(f"agreement: regions finished with different states {sorted(out.finished.items())}")
    for name, (step, _) in out.finished.items():
        if step != schedule.target:
            found.append(f"agreement: {name} finished at step {step}, not {schedule.target}")
    for r in out.rounds:
        after = r["after"]
        if r["consistent"] and len(r["members"]) > 1 and set(r["members"]) >= set(r["live"]):
            if len(set(after.values())) > 1:
                found.append(f"recovery: round {r['step']} with every live region {r['members']} left them apart")
    drivers = {plan.name: plan.driver or plan.name for plan in schedule.regions}
    for r in out.rounds:  # every member of a group gets the same gather, so one driver's regions decide as one
        decided, by_driver = r.get("decided", {}), {}
        for name, stop in decided.items():
            by_driver.setdefault(drivers[name], set()).add(stop)
        if any(len(stops) > 1 for stops in by_driver.values()):
            found.append(f"stop: the regions of one driver in round {r['step']} decided apart {decided}")
    for name, windows in out.windows.items():
        if windows != list(range(len(windows))):
            found.append(f"windows: {name} trained windows {windows} (one twice or skipped)")
    return found
