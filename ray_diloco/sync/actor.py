"""The SyncActor: one Ray actor per region that owns the outer state and talks to the other regions.

It holds θ_global (fp32, full tensors by name, on CPU), the outer Nesterov optimizer and the outer step
counter. Every H inner steps each FSDP rank of the region sends it its shards; once all ranks are in, it
computes Δ = θ_global − θ_region, averages Δ with the other regions over Hivemind (FP16 on the wire,
fp32 accumulation, weights = tokens), applies the outer step and hands each rank its rows of θ_global.
Workers stay a plain training loop; checkpointing, joining and overlap live here.

Overlap (`outer.overlap`): the round runs while the workers train the next H steps, and its update reaches
them one round late. This is the one-step-delay overlap of DiLoCoX (Qi et al. 2025): the workers keep their
local progress and take the averaged update one round later (Streaming DiLoCo's overlap, Douillard et al. 2025,
instead mixes local and global parameters with a factor α after τ steps). At exchange k the workers hand
in θ_local,k; the actor waits for round k−1 (θ_global,k), starts round k with Δ_k = base_k − θ_local,k in the
background, and hands back base_{k+1} = θ_global,k + (θ_local,k − base_k): the newest θ_global plus what the
region trained since its last base, so no inner step is lost and none counts twice (each drift leaves the
workers' base when the θ_global it was averaged into arrives). Blocking DiLoCo is the case base_k = θ_global,k.
The last round, a checkpoint's round, a stop's and a diverged one run blocking: the state they leave is θ_global
itself, which checkpoints and restarts rely on. The pseudo-gradients are one round stale, so the trajectory
differs from blocking DiLoCo; the outer step's arithmetic, and so the regions' bit-for-bit agreement on
θ_global, is the same.

A Δ with NaN/inf (a diverged region) never enters the average: the region sits the round out and adopts the
newer state another region publishes, or stops with an error if no other region has one.

Who is in a round, which state is canonical, when to re-sync and when to stop are decided by
`ray_diloco.sync.policy` from the regions' DHT records; this actor reads the records and carries decisions out.
The actor is six parts: this module (the workers' side: exchange, resume, stop), `scheduling.py` (a round
blocking or overlapped, its bound, the round in flight), `membership.py` (publishing, reading and acting on the
records), `rounds.py` (one round: rendezvous, average, outer step, record), `compressed.py` (the compressed
methods' all-gather) and `checkpoints.py` (commit, resume from one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import numpy as np
import ray
import torch

from ray_diloco import metrics
from ray_diloco.checkpoint import CheckpointStore, join
from ray_diloco.config import ExperimentConfig
from ray_diloco.model import build_model, parameter_state
from ray_diloco.network import region_network
from ray_diloco.sharding import from_wire, rows_for_rank, to_wire
from ray_diloco.sync.averaging import RegionAverager
from ray_diloco.sync.bounded import BoundedCalls
from ray_diloco.sync.checkpoints import Checkpoints
from ray_diloco.sync.compressed import CompressedRounds
from ray_diloco.sync.membership import Membership
from ray_diloco.sync.outer import OuterOptimizer, state_digest
from ray_diloco.sync.policy import StateRecord
from ray_diloco.sync.rounds import PendingRound, Rounds, poison_factor_for_test
from ray_diloco.sync.scheduling import RoundScheduling

logger = logging.getLogger(__name__)
# Events of a healthy run (start-up, a peer met, an outage over, a resume, an autoscaler's resize, a restarted
# group that continued AdamW from its checkpoint): logged at INFO. Every other event is something a user may need
# to act on (inner_state_reset: AdamW started anew), at WARNING.
ROUTINE_EVENTS = frozenset({"hivemind_started", "peer_connected", "dht_recovered", "resumed", "group_resized",
                            "inner_state_restored"})
REPORTED_PEERS = 64  # refused (peer, what) pairs reported as events; the rest are counted


class SyncActorImpl(Membership, RoundScheduling, Rounds, CompressedRounds, Checkpoints):
    """Plain class (tested directly); `SyncActor` below is its Ray actor form. Publishing, reading and acting on
    the regions' records is in `Membership` (membership.py)."""

    def __init__(self, config: dict, region: str, initial_peers: list[str] | None = None,
                 record_rounds: bool = False, evaluator=None, resume_step: int | None = None,
                 secret: bytes | None = None, peers_from: list | None = None):
        """`peers_from`: without initial peers, [the ObjectRef of `multiaddrs()` of this driver's first region's
        actor] (in a list: Ray would wait for a bare one before starting this actor), waited for only once this
        actor's own state is built, so that the regions' actors start side by side."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config = ExperimentConfig.from_dict(config)
        self.region = region
        cfg = self.config
        torch.set_num_threads(1)  # the actor shares the node with training workers
        model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, cfg.run.seed, cfg.run.init_from)
        initial = parameter_state(model)
        del model
        self.shapes = {name: t.shape for name, t in initial.items()}
        self.outer = OuterOptimizer(initial, lr=cfg.outer.lr, momentum=cfg.outer.momentum,
                                    nesterov=cfg.outer.nesterov)
        self._init_round_state(record_rounds, evaluator)
        bootstrap = list(initial_peers or cfg.outer.initial_peers)
        if not bootstrap and peers_from:
            # A plain wait (no method of this actor can run before its constructor returns, so nothing waits on
            # the event loop); ray.get here would print Ray's "blocking ray.get inside async actor" on every run.
            bootstrap = peers_from[0].future().result()
        self.averager = self.sharer = self.payloads = None  # what `shutdown` ends, as far as it got
        try:
            self._start_hivemind(bootstrap, secret)
            self._start_compressor()
            if resume_step is not None:
                self._resume_from_checkpoint(resume_step)
            if self.sharer is not None:
                self._join_the_run(secret)
        except BaseException:
            # Ray calls nothing on an actor whose constructor raised: Hivemind's daemon would be left to die with
            # the process, and its socket files under /tmp for good.
            try:
                self.shutdown()
            except Exception:  # the constructor's own error is the one to raise
                logger.warning("[%s] shutting down a SyncActor that failed to start failed too", region, exc_info=True)
            raise
        metrics.safely(metrics.record_event, cfg.run.name, region, "sync_actor_started")
        metrics.safely(metrics.record_outer_step, cfg.run.name, region, self.outer.step_count)

    def _join_the_run(self, secret: bytes | None) -> None:
        """Say who we are, meet the regions' peers, and take the run's state if it is ahead of ours."""
        self._announce()
        self._dial_peer_files()
        if secret:  # named before we ask: the regions serving us the run's state admit members only
            self._announce_joining()
        self._join_if_behind()
        self._publish_safely(0)

    def _start_hivemind(self, bootstrap: list[str], secret: bytes | None) -> None:
        """The region's Hivemind node (DHT + averager) and its state sharing, where the run has other regions
        (the run's, not this cluster's: the others may run elsewhere) or peers to join. With the run's secret,
        records are signed and checked and only members are served (ray_diloco.sync.auth)."""
        cfg = self.config
        self.expected_regions = len(cfg.regions)
        self.averager = self.sharer = None
        self._rejected: set[tuple[str, str]] = set()  # (peer, what) already reported
        self.peers_rejected = 0  # every refusal, reported or not
        self._connected: set[str] = set()  # regions whose peer file we dialled successfully
        self._peers_read = 0.0  # when we last read the peer files
        self._stored: dict = {}  # region -> durable.StoredRecord: the records kept in the run's storage
        self._stored_read = 0.0  # when we last read them
        self._storage = BoundedCalls()  # every call to the run's storage has a time bound
        if self.expected_regions == 1 and not bootstrap:  # a DHT is only needed across regions
            return
        from ray_diloco.sync.state_sharing import StateSharer, state_key

        network = region_network(cfg, self.region)  # this region's own address settings
        self.averager = RegionAverager(
            run_id=cfg.run.name, region=self.region, expected_regions=max(2, self.expected_regions),
            compression=cfg.outer.compression, initial_peers=bootstrap or None,
            host=network.host, port=network.port, matchmaking_seconds=cfg.outer.matchmaking_seconds,
            averaging_timeout=cfg.outer.averaging_timeout, announce_maddrs=list(network.announce) or None,
            secret=secret, members_key=state_key(cfg.run.name) if secret else None,
            max_weight=float(cfg.max_round_tokens()), aggregation=cfg.outer.aggregation,
            clip_factor=cfg.outer.clip_factor,
        )
        # Every region publishes (outer step, digest of θ_global) and serves its outer state, so a late
        # region re-syncs and a joining one starts from the run's state. A killed region's record
        # expires after `ttl`, which also shrinks the group the others wait for.
        self.sharer = StateSharer(self.averager.dht, cfg.run.name, self.region, self._snapshot,
                                  ttl=2 * cfg.outer.matchmaking_seconds + 10, copy_state=False,
                                  schema={name: (tuple(shape), "float32") for name, shape in self.shapes.items()},
                                  members_only=bool(secret),
                                  on_reject=lambda peer, what: self.peer_rejected(peer.to_base58(), what))

    def peer_rejected(self, peer: str, what: str) -> None:
        """A peer that no signed record of the run names asked us for `what`: an event once per peer and kind, for
        the first REPORTED_PEERS of them (peer IDs cost nothing to make: an intruder must not grow the events and
        summary.json without bound); every refusal is counted (`stats()['peers_rejected']`)."""
        self.peers_rejected += 1
        if (peer, what) not in self._rejected and len(self._rejected) < REPORTED_PEERS:
            self._rejected.add((peer, what))
            self.record_event("peer_rejected", peer=peer, what=what)
            if len(self._rejected) == REPORTED_PEERS:
                logger.warning("[%s] %d refused peers reported; further ones are only counted", self.region,
                               REPORTED_PEERS)

    def _init_round_state(self, record_rounds: bool, evaluator) -> None:
        """Everything the rounds, the workers' exchanges and the summary keep, empty."""
        cfg = self.config
        self._rounds: dict[int, PendingRound] = {}
        self.stop_requested = False
        # The step the region stops at, once a round agreed to (Rounds._stopped_in_flight) or told its workers to:
        # a later hand-in or a restarted group (resume_state) ends there.
        self._stop_at: int | None = None
        self._state_lock = threading.Lock()  # _set_state (executor threads) against resume_state's reads
        self._running_round: asyncio.Event | None = None  # done-event of the round being applied now
        # Overlap: where the region's workers train from now (None: θ_global itself), the step they were told,
        # and the round still running in the background.
        self.base: dict[str, torch.Tensor] | None = None
        self.workers_step = 0
        self._in_flight: asyncio.Future | None = None
        self._in_flight_shards: PendingRound | None = None  # the hand-in of the round in flight (its data position)
        # (workers' step, round_from, reached) of the last round that ended blocking, for late_hand_in
        self._last_blocking_round: tuple[int, int | None, int] | None = None
        # Bumped when a round is abandoned: its executor threads (rendezvous, loads, settling) run on, but may
        # change nothing after that (Membership checks it before each step and under _state_lock).
        self._generation = 0
        self._abandoned_in_a_row = 0  # rounds abandoned since one ended (policy.overdue_round, overdue_in_flight)
        self._handed_back = self._round_ended = time.perf_counter()  # the workers' last start, the last round's end
        self._published: StateRecord | None = None  # our record exactly as the others see it: our vote
        self._dht_failing = False  # the last read of the records failed
        self._phase_failing = False  # the last publish of our phase failed
        self.history: list[dict] = []
        self.bytes_sent = self.bytes_received = 0
        self.sync_seconds = 0.0
        self.tokens = 0
        # The tokens one worker did not train in the windows a preemption notice ended early: the evaluation curve
        # counts whole windows less these (steps taken over from another region's state count as whole windows).
        self.short_tokens = 0
        # Tests re-compute each outer step in plain PyTorch from what the region actually sent.
        self.record_rounds = record_rounds
        self.recorded: list[dict] = []
        self.poison_factor = poison_factor_for_test(self.region)  # tests and benchmarks only (rounds.py)
        self.evaluator = evaluator  # set on one region only: θ_global is the same everywhere
        self.workers: dict[int, dict] = {}  # rank -> {pid, host, node}: who trains this region now
        self.worker_nodes: list[str] = []  # every Ray node that ran one of its workers, in order of first use
        self.events: list[dict] = []  # restarts, departures, joins — for status lines and summary.json
        self._digest = state_digest(self.outer.global_state())
        self._momentum_digest = state_digest(self.outer.momentum_state())  # in our records: a download checks it
        # The region's data position after the last completed round (batches.region_progress): where a restarted
        # or resized group goes on reading. None: the beginning.
        self.progress: dict | None = None
        self.group_workers: int | None = None  # the worker count of the region's group now
        self.store = CheckpointStore(join(cfg.run.checkpoint_root(), self.region))
        self.committed: tuple[int, str] | None = None  # (outer step, worker checkpoint) of the last commit
        self._committing: asyncio.Event | None = None  # set when the commit in progress ends (resume_state)
        self.inner_report: dict = {}  # rank 0's last loss, tokens/s, lr (note_inner): for the live summary

    # -- discovery and state -------------------------------------------------------------------------
    def multiaddrs(self) -> list[str]:
        return self.averager.visible_multiaddrs() if self.averager else []

    def register_worker(self, rank: int, world_size: int, pid: int, host: str, node: str = "") -> None:
        """A worker (re)starts on Ray node `node`. A known rank with a new process is a restart of the region's
        group; a group of another worker count is a resize (Ray Train's elastic scaling, or a restart with the
        nodes it could get)."""
        if self.group_workers is not None and world_size != self.group_workers:
            self.record_event("group_resized", from_workers=self.group_workers, to_workers=world_size)
            self._drop_waiting_rounds(f"the region's group was resized to {world_size} workers")
            self.workers = {r: w for r, w in self.workers.items() if r < world_size}
        self.group_workers = world_size
        metrics.safely(metrics.record_region_workers, self.config.run.name, self.region, world_size)
        previous = self.workers.get(rank)
        if previous is not None and previous["pid"] != pid:
            self.record_event("worker_restart", rank=rank, old_pid=previous["pid"], pid=pid)
            self._drop_waiting_rounds(f"rank {rank} of the region restarted")
        self.workers[rank] = {"pid": pid, "host": host, "node": node, "world_size": world_size}
        if node and node not in self.worker_nodes:
            self.worker_nodes.append(node)

    def _drop_waiting_rounds(self, why: str) -> None:
        """Rounds still gathering shards hold shards of the old group's (dead) ranks: a new rank must not
        complete one of them. Their waiters, if any are alive, get an error instead of waiting forever."""
        for step, pending in list(self._rounds.items()):
            if pending.done is not self._running_round:
                pending.error = RuntimeError(f"[{self.region}] round of outer step {step} dropped: {why}")
                pending.done.set()
                del self._rounds[step]

    def worker_pids(self) -> dict[int, int]:
        return {rank: w["pid"] for rank, w in self.workers.items()}

    def record_event(self, kind: str, **details) -> None:
        event = {"event": kind, "region": self.region, "outer_step": self.outer.step_count,
                 "time": time.time(), **details}
        self.events.append(event)
        logger.log(logging.INFO if kind in ROUTINE_EVENTS else logging.WARNING, "[%s] %s", self.region, event)
        metrics.safely(metrics.record_event, self.config.run.name, self.region, kind)

    def note_inner(self, loss: float, tokens_per_second: float, lr: float) -> None:
        """Rank 0's last inner step before a round (fire-and-forget): the round's record carries it."""
        self.inner_report = {"loss": loss, "tokens_per_second": tokens_per_second, "lr": lr}

    def outer_step(self) -> int:
        return self.outer.step_count

    def global_state(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.outer.global_state().items()}

    def digest(self) -> str:
        return self._digest

    # -- checkpoints: the workers' first, then ours ----------------------------------------------------
    async def resume_state(self, rank: int, world_size: int) -> dict:
        """Where a (re)starting worker of this region continues, all from one state: the outer step, this
        rank's rows of θ_global, the region's data position, and the worker checkpoint (inner AdamW state) of that
        outer step when one is committed, and whether the region stopped there (a stop request's round). A round
        being applied finishes first, so a worker never takes θ_N
        while the actor moves to θ_{N+1} (its next Δ would be computed against the wrong base)."""
        running = self._running_round
        if running is not None:  # the round in flight ends first, then this one: each within the bound
            await asyncio.wait_for(running.wait(), timeout=2 * self._await_bound() + self._commit_bound() + 60.0)
        try:  # an overlapped round in flight ends first; the new group starts from θ_global (its drift is gone)
            await self._finish_in_flight()
        except asyncio.TimeoutError:  # still running: it must not move θ_global under the new group
            self._abandon_in_flight()
        except Exception:  # noqa: BLE001 — failed before its outer step (recorded by _round): θ_global is unchanged
            pass
        committing = self._committing
        if committing is not None:  # the dying group's commit first: a second one of the step would replace it
            await asyncio.wait_for(committing.wait(), timeout=self._commit_bound() + 60.0)
        self.base = None
        self._handed_back = self._round_ended = time.perf_counter()
        # Any worker count: the rows are cut for this group, the worker checkpoint re-shards on load, and the data
        # position is the region's.
        with self._state_lock:
            step = self.outer.step_count
            rows = to_wire(rows_for_rank(self.outer.global_state(), world_size, rank))
        worker_checkpoint = self.committed[1] if self.committed and self.committed[0] == step else None
        # A group restarted after its round told the workers to stop (a worker died while they checkpointed or
        # ended), or after an overlapped round agreed to stop at this step (Rounds._stopped_in_flight), ends there
        # too: training a window would run one more round (a region alone in its driver) or end at the same step a
        # window later, its inner steps lost.
        stop = self._stop_at is not None and step >= self._stop_at
        return {"outer_step": step, "rows": rows, "progress": self.progress,
                "worker_checkpoint": worker_checkpoint, "stop": stop}

    def catch_up(self) -> int:
        """Called by the driver once every region's actor runs: a region that started before its peers, or
        resumed from an older checkpoint than theirs (it left the run early), takes the run's state now,
        before its workers start. Returns the outer step."""
        if self.sharer is not None:
            self._join_if_behind()
            self._publish_safely(0)
        return self.outer.step_count

    def recorded_rounds(self) -> list[dict]:
        return self.recorded

    def tokens_per_worker(self) -> int:
        """What one worker trained into θ_global by now, as the evaluation curve counts it."""
        return self.config.tokens_per_worker(self.outer.step_count) - self.short_tokens

    def last_round(self) -> dict:
        return self.history[-1] if self.history else {}

    def stats(self) -> dict:
        return {
            "region": self.region, "outer_step": self.outer.step_count, "tokens": self.tokens,
            "tokens_per_worker": self.tokens_per_worker(),
            "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
            "sync_seconds": self.sync_seconds, "rounds": list(self.history), "digest": self.digest(),
            "record": dataclasses.asdict(self._published) if self._published else None,
            "events": list(self.events), "peers_rejected": self.peers_rejected,
            "worker_nodes": list(self.worker_nodes),
            # outer steps whose workers have handed in and wait (an overlapped round leaves as they are answered)
            "rounds_handed_in": sorted(self._rounds),
        }

    # -- the outer step ------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """The run was asked to stop (`ray job stop`, SIGTERM, Ctrl-C): the region's workers end after the
        current round, with a checkpoint of it, so the run can continue from there."""
        self.stop_requested = True

    async def exchange(self, outer_step: int, rank: int, world_size: int, shards: dict[str, np.ndarray],
                       tokens: int, progress: dict | None = None, notice: bool = False,
                       hand_in_checkpoint: str | None = None) -> tuple[int, dict[str, np.ndarray], bool]:
        """Called by every rank after H inner steps (fewer where a preemption notice ended the window early) with its
        shards (`outer_step` counts the region's own rounds; shards and rows as `to_wire` arrays); returns the outer
        step now reached (ahead of the workers' count after a re-sync), the rank's rows, and whether to stop there
        (the same answer for every rank). `notice`: a preemption notice stands (the same on every rank), so the
        workers checkpoint this round and it must not overlap (ray_diloco/preemption.py); told where outer.overlap
        is on, the window ended early or an earlier look found the notice, else the workers look for one while
        the round waits and after it. `hand_in_checkpoint`:
        the worker checkpoint the workers saved before this call under that notice; committed here as the round
        ends (`policy.commits_hand_in_checkpoint`), before any rank is answered and whether or not the group is
        still there (a deadline may end it while the round waits for the other regions)."""
        if self.group_workers is not None and world_size != self.group_workers:  # a late call of a resized group
            raise RuntimeError(f"[{self.region}] rank {rank} of a group of {world_size} exchanges, but the region's "
                               f"group has {self.group_workers} workers now")
        expected = self.workers_step if self.base is not None else self.outer.step_count
        if outer_step != expected:
            raise RuntimeError(f"[{self.region}] rank {rank} exchanges outer step {outer_step}, but the region's "
                               f"workers should be at step {expected}: its Δ would be computed against another "
                               "base (the worker group restarts from the current state)")
        pending = self._rounds.setdefault(outer_step, PendingRound(world_size))
        pending.shards[rank] = from_wire(shards)
        pending.tokens_by_rank[rank] = tokens
        pending.progress_by_rank[rank] = progress
        pending.notice = pending.notice or notice
        pending.hand_in_checkpoint = pending.hand_in_checkpoint or hand_in_checkpoint
        if len(pending.shards) == world_size:
            self._running_round = pending.done
            try:
                pending.new_global, pending.reached = await self._complete_round(outer_step, pending)
                # As the round agreed; a round that did not end (abandoned) or runs on (overlapped): the request.
                pending.stop = self.stop_requested if pending.stop_agreed is None else pending.stop_agreed
                if pending.stop:
                    self._stop_at = pending.reached
                await self._commit_hand_in(pending)
                if not pending.overlapped and self._in_flight_shards is not pending:  # for a late hand-in checkpoint
                    self._last_blocking_round = (outer_step, pending.round_from, pending.reached)
            except BaseException as error:  # every waiting rank must see it, not only the last one
                pending.error = error
            finally:
                self._running_round = None
                pending.done.set()
                self._rounds.pop(outer_step, None)
        # The last rank in may first wait for the overlapped round in flight, then run this one: each is abandoned
        # after the bound (the slack: the others handed in before the last rank, and their clock started then).
        await asyncio.wait_for(pending.done.wait(), timeout=2 * self._await_bound() + self._commit_bound() + 120.0)
        if pending.error is not None:
            raise pending.error
        return pending.reached, to_wire(rows_for_rank(pending.new_global, world_size, rank)), pending.stop

    def shutdown(self) -> None:
        self._stop_compressor()
        if self.sharer is not None:
            self.sharer.shutdown()
            self.sharer = None
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None


# One CPU unless the driver asks otherwise (it passes outer.sync_actor_cpus): averaging and the outer step
# run beside the region's workers.
SyncActor = ray.remote(num_cpus=1, max_concurrency=64)(SyncActorImpl)
