"""The SyncActor: one Ray actor per region that owns the outer state and talks to the other regions.

It holds θ_global (fp32, full tensors by name, on CPU), the outer Nesterov optimizer and the outer step
counter. Every H inner steps each FSDP rank of the region sends it its shards; once all ranks are in, it
computes Δ = θ_global − θ_region, averages Δ with the other regions over Hivemind (FP16 on the wire,
fp32 accumulation, weights = tokens), applies the outer step and hands each rank its rows of θ_global.
Workers stay a plain training loop; checkpointing, joining and overlap live here.

A Δ with NaN/inf (a diverged region) never enters the average: the region sits the round out and adopts the
newer state another region publishes, or stops with an error if no other region has one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

import ray
import torch

from ray_diloco import metrics
from ray_diloco.checkpoint import CheckpointStore, OuterCheckpoint, join
from ray_diloco.averaging import RegionAverager, own_result
from ray_diloco.codecs import count_nonfinite
from ray_diloco.config import ExperimentConfig
from ray_diloco.model import build_model, parameter_state
from ray_diloco.outer import OuterOptimizer, state_digest
from ray_diloco.sharding import assemble, rows_for_rank

logger = logging.getLogger(__name__)


@dataclass
class _PendingRound:
    """The shards of one region's ranks for one outer step, gathered until every rank is in."""

    world_size: int
    shards: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    tokens_by_rank: dict[int, int] = field(default_factory=dict)  # by rank: a restarted rank resubmits
    progress_by_rank: dict[int, dict | None] = field(default_factory=dict)  # each rank's data position
    done: asyncio.Event = field(default_factory=asyncio.Event)
    new_global: dict[str, torch.Tensor] | None = None
    error: BaseException | None = None
    first_in: float = field(default_factory=time.perf_counter)  # the first rank's shards arrived
    stop: bool = False  # a stop was requested before the round ended: every rank checkpoints and ends here


class SyncActorImpl:
    """Plain class (tested directly); `SyncActor` below is its Ray actor form."""

    def __init__(self, config: dict, region: str, initial_peers: list[str] | None = None,
                 record_rounds: bool = False, evaluator=None, resume_step: int | None = None):
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
        self.expected_regions = len(cfg.regions)
        self.averager = self.sharer = None
        peers = list(initial_peers or cfg.outer.initial_peers)
        if self.expected_regions > 1 or peers:  # a DHT is only needed across regions
            from ray_diloco.state_sharing import StateSharer

            self.averager = RegionAverager(
                run_id=cfg.run.name, region=region, expected_regions=max(2, self.expected_regions),
                compression=cfg.outer.compression, initial_peers=peers or None,
                host=cfg.outer.host, matchmaking_seconds=cfg.outer.matchmaking_seconds,
                averaging_timeout=cfg.outer.averaging_timeout,
            )
            # Every region publishes (outer step, digest of θ_global) and serves its outer state, so a late
            # region re-syncs and a joining one starts from the run's state. A killed region's record
            # expires after `ttl`, which also shrinks the group the others wait for.
            self.sharer = StateSharer(self.averager.dht, cfg.run.name, region, self._snapshot,
                                      ttl=2 * cfg.outer.matchmaking_seconds + 10, copy_state=False)
        self._rounds: dict[int, _PendingRound] = {}
        self.stop_requested = False
        self._state_lock = threading.Lock()  # _set_state (executor threads) against resume_state's reads
        self._running_round: asyncio.Event | None = None  # done-event of the round being applied now
        self._published_group = 0  # group size of the round behind our published record
        self.history: list[dict] = []
        self.bytes_sent = self.bytes_received = 0
        self.sync_seconds = 0.0
        self.tokens = 0
        # Tests re-compute each outer step in plain PyTorch from what the region actually sent.
        self.record_rounds = record_rounds
        self.recorded: list[dict] = []
        self.evaluator = evaluator  # set on one region only: θ_global is the same everywhere
        self.workers: dict[int, dict] = {}  # rank -> {pid, host}: who trains this region now
        self.events: list[dict] = []  # restarts, departures, joins — for status lines and summary.json
        self._digest = state_digest(self.outer.global_state())
        # rank -> data position after the last completed round: where a restarted worker goes on reading.
        self.progress: dict[int, dict | None] = {}
        self.store = CheckpointStore(join(cfg.run.checkpoint_root(), region))
        self.committed: tuple[int, str] | None = None  # (outer step, worker checkpoint) of the last commit
        if resume_step is not None:
            self._resume_from_checkpoint(resume_step)
        if self.sharer is not None:
            self._join_if_behind()
            self._publish(group_size=0)
        self.inner_report: dict = {}  # rank 0's last loss, tokens/s, lr (note_inner): for the live summary
        metrics.safely(metrics.record_event, cfg.run.name, region, "sync_actor_started")
        metrics.safely(metrics.record_outer_step, cfg.run.name, region, self.outer.step_count)

    # -- discovery and state -------------------------------------------------------------------------
    def multiaddrs(self) -> list[str]:
        return self.averager.visible_multiaddrs() if self.averager else []

    def register_worker(self, rank: int, world_size: int, pid: int, host: str) -> None:
        """A worker (re)starts. A known rank with a new process is a restart of the region's group."""
        previous = self.workers.get(rank)
        if previous is not None and previous["pid"] != pid:
            self.record_event("worker_restart", rank=rank, old_pid=previous["pid"], pid=pid)
            self._drop_waiting_rounds(f"rank {rank} of the region restarted")
        self.workers[rank] = {"pid": pid, "host": host, "world_size": world_size}

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
        logger.warning("[%s] %s", self.region, event)
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

    # -- membership: publish, re-sync, join --------------------------------------------------------------
    def _snapshot(self) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        clone = lambda tensors: {name: t.clone() for name, t in tensors.items()}  # noqa: E731
        return self.outer.step_count, clone(self.outer.global_state()), clone(self.outer.momentum_state())

    def _own_record(self, group_size: int):
        from ray_diloco.state_sharing import StateRecord

        return StateRecord(self.region, self.outer.step_count, self._digest, group_size)

    def _publish(self, group_size: int) -> None:
        self.sharer.publish(self._own_record(group_size), state=self._snapshot(), verify=False)
        # Our vote in choose_canonical must be the record the others see: voting with another group size
        # made two diverged regions each prefer the other's state and swap states every round.
        self._published_group = group_size

    def _publish_safely(self, group_size: int) -> None:
        """Publish after an outer step. θ has advanced already, so a DHT timeout here must not fail the round
        (progress, tokens and history would lag θ): the sharer keeps the new record and its refresher
        thread stores it again every ttl/3."""
        try:
            self._publish(group_size)
        except Exception as error:
            self._published_group = group_size
            self.record_event("dht_error", during="publishing the state record", error=repr(error)[:300])

    def _adopt(self, want, kind: str) -> bool:
        """Load θ_global, momentum and outer step from a peer holding `want` (a StateRecord)."""
        state = self.sharer.load_from_peers(want, timeout=self.config.outer.averaging_timeout)
        if state is None:
            self.record_event(f"{kind}_failed", wanted_step=want.outer_step, wanted_digest=want.digest)
            return False
        old_step = self.outer.step_count
        self._set_state(*state)
        self.record_event(kind, from_step=old_step, to_step=self.outer.step_count, digest=self._digest,
                          source=want.region)
        return True

    def _set_state(self, step: int, theta: dict, momentum: dict) -> None:
        """Replace the outer state at once (it may run in an executor thread while `resume_state` reads)."""
        cfg = self.config.outer
        outer = OuterOptimizer(theta, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
        outer.load_momentum(momentum)
        outer.step_count = step
        digest = state_digest(outer.global_state())
        with self._state_lock:
            self.outer, self._digest = outer, digest
        metrics.safely(metrics.record_outer_step, self.config.run.name, self.region, step)

    def _resume_from_checkpoint(self, step: int) -> None:
        """`step`: the outer step the driver resumes all its regions from."""
        checkpoint = self.store.load(step)
        self._set_state(checkpoint.outer_step, checkpoint.theta, checkpoint.momentum)
        self.progress, self.tokens = checkpoint.progress, checkpoint.tokens
        self.committed = (checkpoint.outer_step, checkpoint.worker_checkpoint)
        self.record_event("resumed", checkpoint=self.store.location(checkpoint.outer_step), digest=self._digest)

    # -- checkpoints: the workers' first, then ours ----------------------------------------------------
    async def resume_state(self, rank: int, world_size: int) -> dict:
        """Where a (re)starting worker of this region continues, all from one state: the outer step, this
        rank's rows of θ_global, its data position, and the worker checkpoint (inner AdamW state) of that
        outer step when one is committed. A round being applied finishes first, so a worker never takes θ_N
        while the actor moves to θ_{N+1} (its next Δ would be computed against the wrong base)."""
        running = self._running_round
        if running is not None:
            await asyncio.wait_for(running.wait(), timeout=self._await_bound())
        # A different worker count is refused where the state is used: by the worker checkpoint loader and
        # by WorkerBatches, whose position is only valid for the worker count that saved it.
        with self._state_lock:
            step = self.outer.step_count
            rows = rows_for_rank(self.outer.global_state(), world_size, rank)
        worker_checkpoint = self.committed[1] if self.committed and self.committed[0] == step else None
        return {"outer_step": step, "rows": rows, "progress": self.progress.get(rank),
                "worker_checkpoint": worker_checkpoint}

    def _await_bound(self) -> float:
        """The longest any call waits on a round: its other ranks arrive within seconds; the round itself is
        bounded by the averaging timeout (plus a re-sync download)."""
        return 3 * self.config.outer.averaging_timeout + 60.0

    async def commit_checkpoint(self, outer_step: int, worker_checkpoint: str) -> str:
        """Called by rank 0 once every rank has uploaded its worker checkpoint of `outer_step`: saves θ_global,
        momentum, outer step and data progress, marked complete last. Returns the checkpoint's location."""
        if outer_step != self.outer.step_count:
            raise RuntimeError(f"[{self.region}] commit of outer step {outer_step}, but the outer state is at "
                               f"step {self.outer.step_count}")
        step, theta, momentum = self._snapshot()
        checkpoint = OuterCheckpoint(outer_step=step, theta=theta, momentum=momentum, progress=dict(self.progress),
                                     worker_checkpoint=worker_checkpoint, tokens=self.tokens,
                                     config_yaml=self.config.to_yaml())
        # Off the event loop: other regions' calls (state sharing) go on while the files are written.
        location = await asyncio.get_running_loop().run_in_executor(None, self.store.save, checkpoint)
        self.committed = (step, worker_checkpoint)
        logger.info("[%s] checkpoint of outer step %d committed: %s", self.region, step, location)
        return location

    def catch_up(self) -> int:
        """Called by the driver once every region's actor runs: a region that started before its peers, or
        resumed from an older checkpoint than theirs (it left the run early), takes the run's state now,
        before its workers start. Returns the outer step."""
        if self.sharer is not None:
            self._join_if_behind()
            self._publish(group_size=0)
        return self.outer.step_count

    def _join_if_behind(self) -> None:
        """A region starting mid-run takes the run's state before its workers take their first step."""
        from ray_diloco.state_sharing import choose_canonical

        others = [r for r in self.sharer.records() if r.region != self.region]
        canonical = choose_canonical(others)
        if canonical is not None and canonical.outer_step > self.outer.step_count:
            self._adopt(canonical, "region_joined")

    def _resync_and_count_regions(self) -> None:
        """Before a round: adopt the canonical state if ours diverged (a round we missed or that failed),
        and expect as many regions as publish a live record (departed ones expire, joined ones appear)."""
        from ray_diloco.state_sharing import needs_resync

        try:
            records = self.sharer.records()
        except Exception as error:  # a DHT that did not answer in time must not end the region's group
            self.record_event("dht_error", during="reading state records", error=repr(error)[:300])
            return  # this round: no re-sync, the last known group size
        target = needs_resync(self._own_record(self._published_group), records)
        if target is not None:
            self._adopt(target, "resync")
        # Every region with a live record counts, also one still catching up: it re-syncs at its next
        # exchange and joins the round the others wait in. Departed regions drop out when their record expires.
        live = {r.region for r in records} | {self.region}
        self.averager.expected_regions = len(live)  # 1: nobody else is left, the round runs alone at once

    def recorded_rounds(self) -> list[dict]:
        return self.recorded

    def last_round(self) -> dict:
        return self.history[-1] if self.history else {}

    def stats(self) -> dict:
        return {
            "region": self.region, "outer_step": self.outer.step_count, "tokens": self.tokens,
            "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
            "sync_seconds": self.sync_seconds, "rounds": list(self.history), "digest": self.digest(),
            "events": list(self.events),
        }

    # -- the outer step ------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """The run was asked to stop (`ray job stop`, SIGTERM, Ctrl-C): the region's workers end after the
        current round, with a checkpoint of it, so the run can continue from there."""
        self.stop_requested = True

    async def exchange(self, outer_step: int, rank: int, world_size: int, shards: dict[str, torch.Tensor],
                       tokens: int, progress: dict | None = None) -> tuple[int, dict[str, torch.Tensor], bool]:
        """Called by every rank after H inner steps (`outer_step` counts the region's own rounds); returns
        the outer step now reached (ahead of the workers' count after a re-sync), the rank's rows, and
        whether to stop there (the same answer for every rank of the round)."""
        if outer_step != self.outer.step_count:
            raise RuntimeError(f"[{self.region}] rank {rank} exchanges outer step {outer_step}, but the region's "
                               f"outer state is at step {self.outer.step_count}: its Δ would be computed against "
                               "another θ_global (the worker group restarts from the current state)")
        pending = self._rounds.setdefault(outer_step, _PendingRound(world_size))
        pending.shards[rank] = shards
        pending.tokens_by_rank[rank] = tokens
        pending.progress_by_rank[rank] = progress
        if len(pending.shards) == world_size:
            self._running_round = pending.done
            try:
                pending.new_global = await self._run_round(outer_step, pending)
                self.progress = dict(pending.progress_by_rank)
                pending.stop = self.stop_requested
            except BaseException as error:  # every waiting rank must see it, not only the last one
                pending.error = error
            finally:
                self._running_round = None
                pending.done.set()
                self._rounds.pop(outer_step, None)
        await asyncio.wait_for(pending.done.wait(), timeout=self._await_bound())
        if pending.error is not None:
            raise pending.error
        return self.outer.step_count, rows_for_rank(pending.new_global, world_size, rank), pending.stop

    async def _run_round(self, workers_step: int, pending: _PendingRound) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        local = assemble(pending.shards, self.shapes)
        # The region's own pseudo-gradient: from the θ_global its workers started this round from.
        delta = self.outer.pseudo_gradient(local)
        bad = sum(count_nonfinite(t) for t in delta.values())
        if bad:  # a diverged region stays out of the average and takes the others' state instead
            return await self._skip_nonfinite_round(bad, pending, start)
        reduce_started = time.perf_counter()
        if self.sharer is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._resync_and_count_regions)
        outer_step = self.outer.step_count
        if outer_step >= self.config.run.outer_steps:
            # A re-sync took us to the run's last step (the others finished without us): a round now would
            # apply our stale Δ alone and end past T with a θ_global nobody else holds.
            self.record_event("round_skipped_at_end", workers_step=workers_step)
            return {name: t.clone() for name, t in self.outer.global_state().items()}
        tokens = sum(pending.tokens_by_rank.values())
        weight = float(max(tokens, 1))
        compression = self.config.outer.compression
        if self.averager is None:
            # One region: no wire, but the same codec rounding, so results match a multi-region run.
            result = own_result(compression, self.region, delta)
        else:
            try:
                result = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: self.averager.average(delta, weight=weight, round_index=outer_step)
                )
            except Exception as error:  # the region goes on alone this round rather than dying
                self.record_event("averaging_error", error=repr(error)[:300])
                result = own_result(compression, self.region, delta, consistent=False, error=repr(error))
        averaged = result.averaged
        reduce_seconds = time.perf_counter() - reduce_started
        record = {"outer_step": outer_step, "tokens": tokens, "group_size": result.group_size,
                  "peers": list(result.peer_regions), "bytes_sent": result.bytes_sent,
                  "bytes_received": result.bytes_received, "consistent": result.consistent}
        if self.averager is not None:
            record["average_seconds"] = round(result.seconds, 3)
            self.bytes_sent += result.bytes_sent
            self.bytes_received += result.bytes_received
            if result.group_size < self.averager.expected_regions:
                logger.warning("[%s] outer step %d averaged with %d of %d regions: %s", self.region,
                               outer_step, result.group_size, self.averager.expected_regions,
                               result.peer_regions)
            if not result.consistent:
                logger.error("[%s] outer step %d: a region dropped mid-round; parts stayed un-averaged",
                             self.region, outer_step)
        new_global = self.outer.step(averaged)
        self._digest = state_digest(new_global)
        if self.sharer is not None:  # a round that failed mid-way is a weak vote: group of one
            group = record["group_size"] if record["consistent"] else 1
            await asyncio.get_running_loop().run_in_executor(None, lambda: self._publish_safely(group))
        seconds = time.perf_counter() - start
        self.sync_seconds += seconds
        self.tokens += tokens
        wait_seconds = start - pending.first_in
        record.update(seconds=round(seconds, 3), digest=self._digest, wait_seconds=round(wait_seconds, 3),
                      all_reduce_seconds=round(reduce_seconds, 3), apply_seconds=round(seconds - reduce_seconds, 3),
                      **self.inner_report)
        self.history.append(record)
        metrics.safely(metrics.record_round, self.config.run.name, self.region, self.outer.step_count,
                       record["group_size"], wait_seconds, reduce_seconds, seconds - reduce_seconds,
                       record["bytes_sent"] if self.averager is not None else 0,
                       record["bytes_received"] if self.averager is not None else 0)
        if self.record_rounds:
            self.recorded.append({"local": local, "tokens": tokens,
                                  "global_after": {k: v.clone() for k, v in new_global.items()}})
        every = self.config.run.eval_every
        if self.evaluator is not None and every and (outer_step + 1) % every == 0:
            self.evaluator.evaluate.remote(outer_step + 1, {k: v.clone() for k, v in new_global.items()})
        logger.info("[%s] outer step %d done in %.2fs with %d region(s)", self.region, outer_step + 1,
                    seconds, record["group_size"])
        return new_global

    async def _skip_nonfinite_round(self, bad: int, pending: _PendingRound, start: float) -> dict[str, torch.Tensor]:
        """Δ has `bad` NaN/inf values: send nothing (the others do not find this region in matchmaking and
        average without it), then adopt the newer state another region publishes. Raises if there is none."""
        own_step = self.outer.step_count
        self.record_event("nonfinite_pseudo_gradient", bad_values=bad)
        if self.sharer is None or not await asyncio.get_running_loop().run_in_executor(
                None, self._resync_from_newer, own_step):
            raise RuntimeError(f"region {self.region}: pseudo-gradient has {bad} non-finite values and no other "
                               f"region holds a newer state to re-sync from; lower inner.lr or check the data")
        await asyncio.get_running_loop().run_in_executor(None, lambda: self._publish_safely(0))
        seconds = time.perf_counter() - start
        self.sync_seconds += seconds
        # Its tokens went into no average: not counted. group_size 0: this region took part in no round.
        self.history.append({"outer_step": own_step, "tokens": sum(pending.tokens_by_rank.values()),
                             "group_size": 0, "peers": [], "bytes_sent": 0, "bytes_received": 0,
                             "consistent": True, "nonfinite_values": bad, "seconds": round(seconds, 3),
                             "digest": self._digest})
        return self.outer.global_state()

    def _resync_from_newer(self, own_step: int) -> bool:
        """Wait (up to outer.averaging_timeout) for another region's record past `own_step`; adopt the
        canonical one. False if none appeared or none could be loaded in time."""
        from ray_diloco.state_sharing import choose_canonical

        deadline = time.monotonic() + self.config.outer.averaging_timeout
        while True:
            try:
                records = self.sharer.records()
            except Exception as e:  # the DHT did not answer in time: ask again until the deadline
                logger.warning("[%s] reading the state records failed: %r", self.region, e)
                records = []
            newer = [r for r in records if r.region != self.region and r.outer_step > own_step]
            canonical = choose_canonical(newer)
            if canonical is not None and self._adopt(canonical, "resync"):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)

    def shutdown(self) -> None:
        if self.sharer is not None:
            self.sharer.shutdown()
            self.sharer = None
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None


# One CPU unless the driver asks otherwise (it passes outer.sync_actor_cpus): averaging and the outer step
# run beside the region's workers.
SyncActor = ray.remote(num_cpus=1, max_concurrency=64)(SyncActorImpl)
