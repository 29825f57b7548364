"""One outer round of a region's SyncActor, once every rank's shards are in: the rendezvous with the other
regions (`Membership._rendezvous`, decided by `policy`), the average of Δ over Hivemind, the outer Nesterov step,
the published record, and what the round leaves behind (history for summary.json, metrics, the evaluator's
θ_global). A Δ with NaN/inf sits the round out and re-syncs from a newer state instead.

A mixin of `SyncActorImpl` (actor.py): the actor's state lives there; this module is the round's logic, kept
apart from the workers' side of the actor (exchange, resume, checkpoints) so each reads in one sitting.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from ray_diloco import metrics
from ray_diloco.sharding import to_wire
from ray_diloco.sync import policy
from ray_diloco.sync.averaging import own_result
from ray_diloco.sync.codecs import count_nonfinite
from ray_diloco.sync.outer import state_digest
from ray_diloco.sync.policy import FINISHED, OUT, UNSETTLED

logger = logging.getLogger("ray_diloco.sync.actor")  # the actor's log: one stream per region
POISON_ENV_VAR = "RAY_DILOCO_TEST_POISON"  # tests and benchmarks only: "<region>:<factor>"


def poison_factor_for_test(region: str) -> float | None:
    """Tests and benchmarks only: the region named in RAY_DILOCO_TEST_POISON sends its Δ times the factor given
    (a member with the secret sending a poisoned Δ, ×1000 or sign-flipped: benchmarks/poisoned.py); None for the
    others. Read when the SyncActor starts, so a job's environment sets it."""
    name, _, factor = os.environ.get(POISON_ENV_VAR, "").partition(":")
    if name != region or not factor:
        return None
    try:
        return float(factor)
    except ValueError:
        raise ValueError(f"{POISON_ENV_VAR}={name}:{factor}: the factor must be a number") from None


@dataclass
class PendingRound:
    """The shards of one region's ranks for one outer step, gathered until every rank is in."""

    world_size: int
    shards: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    tokens_by_rank: dict[int, int] = field(default_factory=dict)  # by rank: a restarted rank resubmits
    progress_by_rank: dict[int, dict | None] = field(default_factory=dict)  # each rank's data position
    done: asyncio.Event = field(default_factory=asyncio.Event)
    new_global: dict[str, torch.Tensor] | None = None
    error: BaseException | None = None
    first_in: float = field(default_factory=time.perf_counter)  # the first rank's shards arrived
    stop: bool = False  # the region ends at this round (a stop request): every rank checkpoints and ends here
    stop_agreed: bool | None = None  # the round's decision (policy.stops_after_round); None: it did not end
    reached: int = 0  # the outer step the workers go on from
    overlapped: bool = False  # the round runs while the workers train on (outer.overlap)
    # a preemption notice stands (told under outer.overlap, a window ended early, or known from an earlier look):
    # no overlap
    notice: bool = False
    hand_in_checkpoint: str | None = None  # the workers' checkpoint saved under that notice, for the round's state
    round_from: int | None = None  # the outer step its own round started from, blocking (None: overlapped, or none)
    idle_after: float = 0.0  # seconds from the round's start to the time the others' deadline counts from
    inner_report: dict = field(default_factory=dict)  # rank 0's last inner step before this round (note_inner)


class Rounds:
    """The round logic of `SyncActorImpl` (see the module docstring)."""

    async def _run_round(self, workers_step: int, pending: PendingRound, local: dict[str, torch.Tensor],
                         delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rendezvous, average Δ with the group, apply the outer step, publish, record. Returns θ_global."""
        start = time.perf_counter()
        if self.poison_factor is not None:  # tests and benchmarks only: a member that sends a poisoned Δ
            delta = {name: torch.mul(t, self.poison_factor) for name, t in delta.items()}
        bad = sum(count_nonfinite(t) for t in delta.values())
        if bad:  # a diverged region stays out of the average and takes the others' state instead
            return await self._skip_nonfinite_round(bad, pending, start)
        expected, generation = 1, self._generation
        if self.sharer is not None:
            decision = await self._in_executor(self._rendezvous, time.monotonic() + pending.idle_after, generation)
            if isinstance(decision, policy.Finish):
                # Re-synced to the run's last step (the others finished without us): a round now would apply
                # our stale Δ alone and end past T with a θ_global nobody else holds.
                self.record_event("round_skipped_at_end", workers_step=workers_step)
                await self._in_executor(self._settle_at_end, generation)
                return {name: t.clone() for name, t in self.outer.global_state().items()}
            if decision.absent:
                self.record_event("regions_absent", regions=list(decision.absent),
                                  waited_seconds=round(time.perf_counter() - start, 3))
            expected = decision.expected
        rendezvous_seconds = time.perf_counter() - start
        outer_step, tokens = self.outer.step_count, sum(pending.tokens_by_rank.values())
        asked = self.stop_requested  # handed to the group with Δ: the same decision in every region of our driver
        result = await self._average(delta, tokens, outer_step, expected, {"stop": asked})
        ours = frozenset(r.name for r in self.config.local_regions())
        pending.stop_agreed = policy.stops_after_round(asked, [data for _, data in result.members], ours,
                                                       asked_since=self.stop_requested)
        if pending.stop_agreed and len(ours) > 1:  # workers already handed back (overlapped, or the round ran
            self._stop_at = outer_step + 1  # past its bound) end at their next hand-in, as the others did here
        reduce_seconds = time.perf_counter() - start
        new_global = self.outer.step(result.averaged)
        if result.method_state is not None:  # with the outer step, never without it (compressed.py)
            self.compressor.state = result.method_state
        self._digest = state_digest(new_global)
        self._momentum_digest = state_digest(self.outer.momentum_state())
        if self.sharer is not None:
            group = policy.published_group(result.group_size, result.consistent)
            await self._in_executor(lambda: self._publish_safely(group))
        seconds = time.perf_counter() - start
        self.sync_seconds += seconds
        self.tokens += tokens
        # Every rank trains as many steps; a window a notice ended early trained fewer than a whole one.
        per_rank = round(tokens / max(1, len(pending.tokens_by_rank)))
        self.short_tokens += max(0, self.config.tokens_per_worker(1) - per_rank)
        # The transfer is what hivemind timed as its all-reduce; the rest of the averaging call is matchmaking.
        transfer = min(result.timings.get("allreduce", 0.0), reduce_seconds - rendezvous_seconds)
        phases = {"wait_for_shards": start - pending.first_in, "wait_for_peers": reduce_seconds - transfer,
                  "all_reduce": transfer, "apply": seconds - reduce_seconds}
        # A DHT call (up to seconds): off the event loop, which the region's ranks' exchange calls share.
        peers = await self._in_executor(self.averager.connected_peers) if self.averager is not None else None
        self._record_round(outer_step, tokens, result, phases, pending, local, delta, new_global, peers)
        every = self.config.run.eval_every
        if self.evaluator is not None and every and (outer_step + 1) % every == 0:
            # Ray copies θ here
            self.evaluator.evaluate.remote(outer_step + 1, to_wire(new_global), self.tokens_per_worker())
        logger.info("[%s] outer step %d done in %.2fs with %d region(s)", self.region, outer_step + 1,
                    seconds, result.group_size)
        if self.sharer is not None and self.outer.step_count >= self.config.run.outer_steps:
            await self._in_executor(self._settle_at_end, generation)
            new_global = self.outer.global_state()  # the canonical state, if the last round left us apart
        return new_global

    def _stopped_in_flight(self, pending: PendingRound) -> bool:
        """Whether a round that ended after its workers were handed back (overlapped, or finished in the
        background past its bound) agreed to stop (policy.stops_after_round) while they trained on: the regions
        of our driver that blocked on it ended there, and so do these. Their window is not averaged; after a
        resubmit it is read again (the data position stays that round's), and its inner steps are lost."""
        if self._stop_at is None or self.outer.step_count < self._stop_at:
            return False
        self._drop_overlap_base()
        pending.stop_agreed = True
        return True

    async def _in_executor(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)

    async def _average(self, delta: dict[str, torch.Tensor], tokens: int, outer_step: int, expected: int,
                       flags: dict):
        """Δ averaged with the group of `expected` regions (alone: own Δ through the same codec rounding, so the
        result matches a multi-region run); an averaging error costs this round, not the region. `flags` go to
        every member with the group (RoundResult.members)."""
        if self.compressor is not None:  # sparseloco, dct: payloads all-gathered (compressed.py)
            return await self._in_executor(self._average_compressed, delta, tokens, outer_step, expected, flags)
        compression = self.config.outer.compression
        if self.averager is None:
            return own_result(compression, self.region, delta)
        try:
            result = await self._in_executor(lambda: self.averager.average(
                delta, weight=float(max(tokens, 1)), round_index=outer_step, expected_regions=expected,
                checked_finite=True, gather=flags))
            for peer, what in self.averager.take_rejections():  # joins its averager refused (a secret's run)
                self.peer_rejected(peer, what)
        except Exception as error:  # the region goes on alone this round rather than dying
            self.record_event("averaging_error", error=repr(error)[:300])
            return own_result(compression, self.region, delta, consistent=False, error=repr(error))
        if result.group_size < expected:
            logger.warning("[%s] outer step %d averaged with %d of %d regions: %s", self.region, outer_step,
                           result.group_size, expected, result.peer_regions)
        if not result.consistent:
            logger.error("[%s] outer step %d: a region dropped mid-round; parts stayed un-averaged", self.region,
                         outer_step)
        return result

    def _record_round(self, outer_step: int, tokens: int, result, phases: dict[str, float], pending: PendingRound,
                      local: dict, delta: dict, new_global: dict, connected_peers: int | None) -> None:
        """The round in the history (summary.json's `rounds`), the metrics and, for tests, what was sent."""
        wire = self.averager is not None
        record = {"outer_step": outer_step, "tokens": tokens, "group_size": result.group_size,
                  "peers": list(result.peer_regions), "bytes_sent": result.bytes_sent,
                  "bytes_received": result.bytes_received, "consistent": result.consistent}
        if result.payload_bytes:  # a compressed method: what this region's payload costs, per parameter
            record["payload_bytes"] = result.payload_bytes
        if result.clipped:  # outer.aggregation 'clipped': who sent a Δ far beyond the others', by how much
            record["clipped"] = dict(result.clipped)
            self.record_event("contribution_clipped", outer_step=outer_step, scales=dict(result.clipped))
        if wire:
            record["average_seconds"] = round(result.seconds, 3)
            self.bytes_sent += result.bytes_sent
            self.bytes_received += result.bytes_received
        seconds = sum(phases.values()) - phases["wait_for_shards"]
        record.update(seconds=round(seconds, 3), digest=self._digest, wait_seconds=round(phases["wait_for_shards"], 3),
                      overlapped=pending.overlapped,
                      all_reduce_seconds=round(phases["wait_for_peers"] + phases["all_reduce"], 3),
                      wait_for_peers_seconds=round(phases["wait_for_peers"], 3),
                      transfer_seconds=round(phases["all_reduce"], 3), apply_seconds=round(phases["apply"], 3),
                      **pending.inner_report)
        self.history.append(record)
        metrics.safely(metrics.record_round, self.config.run.name, self.region, self.outer.step_count,
                       record["group_size"], phases, record["bytes_sent"] if wire else 0,
                       record["bytes_received"] if wire else 0,
                       connected_peers, sum(shape.numel() for shape in self.shapes.values()))
        if self.record_rounds:
            self.recorded.append({"local": local, "delta": delta, "tokens": tokens,
                                  "global_after": {k: v.clone() for k, v in new_global.items()}})

    async def _skip_nonfinite_round(self, bad: int, pending: PendingRound, start: float) -> dict[str, torch.Tensor]:
        """Δ has `bad` NaN/inf values: send nothing (the others do not find this region in matchmaking and
        average without it), then adopt the newer state another region publishes. Raises if there is none."""
        own_step, generation = self.outer.step_count, self._generation
        self.record_event("nonfinite_pseudo_gradient", bad_values=bad)
        if self._published is not None and self._published.phase in (FINISHED, UNSETTLED):
            # Ended already (a re-sync reached the run's end during an overlapped round): the region's end is
            # final and published; its Δ is dropped, nothing is published or adopted after it.
            return self.outer.global_state()
        if self.sharer is not None:  # the others do not wait for us this round
            await asyncio.get_running_loop().run_in_executor(None, self._set_phase_safely, OUT)
        why = "no other region holds a newer state to re-sync from (a run of one region)"
        if self.sharer is not None:
            why = await asyncio.get_running_loop().run_in_executor(None, self._resync_from_newer, own_step, generation)
        if why is not None:
            raise RuntimeError(f"region {self.region}: pseudo-gradient has {bad} non-finite values and {why}; "
                               "lower inner.lr or check the data")
        await asyncio.get_running_loop().run_in_executor(None, lambda: self._publish_safely(0))
        if self.outer.step_count >= self.config.run.outer_steps:  # re-synced to the run's end: settle, as a round
            await asyncio.get_running_loop().run_in_executor(None, self._settle_at_end, generation)
        seconds = time.perf_counter() - start
        self.sync_seconds += seconds
        # Its tokens went into no average: not counted. group_size 0: this region took part in no round.
        self.history.append({"outer_step": own_step, "tokens": sum(pending.tokens_by_rank.values()),
                             "group_size": 0, "peers": [], "bytes_sent": 0, "bytes_received": 0,
                             "consistent": True, "nonfinite_values": bad, "seconds": round(seconds, 3),
                             "digest": self._digest})
        return self.outer.global_state()
