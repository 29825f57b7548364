"""When a region's round runs, and what a round that overruns costs: blocking (the workers wait for θ_global) or
overlapped (the round runs in the background while they train the next window, `outer.overlap`; see actor.py's
docstring for the scheme), the bound after which a round is given up, and the round still in flight that the next
hand-in or a restarting group waits for first. A slow round costs that round, never the group: raising to the
workers is a Ray Train failure, and repeated slow rounds would use up `run.max_failures`; only
`policy.ABANDONED_ROUNDS_LIMIT` rounds in a row (the region's Hivemind node does not answer) raise.

A mixin of `SyncActorImpl` (actor.py): the actor's state lives there; `Rounds` (rounds.py) runs one round.
"""

from __future__ import annotations

import asyncio
import time

import torch

from ray_diloco.batches import region_progress
from ray_diloco.sharding import assemble
from ray_diloco.sync import policy
from ray_diloco.sync.codecs import count_nonfinite
from ray_diloco.sync.outer import pseudo_gradient
from ray_diloco.sync.rounds import PendingRound


class RoundScheduling:
    """Blocking or overlapped rounds, their bound and the round in flight (see the module docstring)."""

    def _await_bound(self) -> float:
        """How long a round may take before it is given up (`policy.round_bound`). A blocking round is abandoned
        after it (`_blocking_round`); `exchange` and `resume_state` wait twice this (the round in flight ends first)."""
        outer = self.config.outer
        return policy.round_bound(outer.max_wait_seconds, outer.averaging_timeout, self._download_seconds())

    async def _complete_round(self, workers_step: int, pending: PendingRound) -> tuple[dict, int]:
        """Every rank is in: returns the state the workers go on from and its outer step. Blocking: after the
        round. Overlapped: at once, with the round of these shards running in the background."""
        try:
            await self._finish_in_flight()
        except asyncio.TimeoutError:  # a slow round costs that round, never the group, unless it is one of many
            action, self._abandoned_in_a_row = policy.overdue_in_flight(self._abandoned_in_a_row)
            self._abandon_in_flight(in_a_row=self._abandoned_in_a_row)
            self._drop_overlap_base()
            if action == policy.FAIL:  # these batches were read: a restarted group reads on after them
                self._take_progress(pending)
                raise self._node_does_not_answer()
        except Exception:  # noqa: BLE001 — it failed before its outer step (recorded by _round): the same
            self._drop_overlap_base()
        if self._stopped_in_flight(pending):
            return {name: t.clone() for name, t in self.outer.global_state().items()}, self.outer.step_count
        pending.inner_report = dict(self.inner_report)  # an overlapped round ends after the next window's note
        now = time.perf_counter()  # the others' deadline counts from policy.round_arrival, up to a window later
        pending.idle_after = policy.round_arrival(now, self._round_ended, pending.first_in - self._handed_back) - now
        local = assemble(pending.shards, self.shapes)
        # The region's own pseudo-gradient: from the state its workers started this round from.
        base = self.base if self.base is not None else self.outer.global_state()
        delta = pseudo_gradient(base, local)
        if not self._overlaps(delta, pending.notice):
            self.base = None
            pending.round_from = self.outer.step_count  # after the round in flight, abandoned or not
            new_global = await self._blocking_round(workers_step, pending, local, delta)
            self._handed_back = time.perf_counter()
            return new_global, self.outer.step_count
        newest = self.outer.global_state()
        self.base = {name: torch.add(newest[name], torch.sub(local[name], base[name])) for name in newest}
        self.workers_step = self.outer.step_count + 1
        pending.overlapped = True
        self._in_flight = asyncio.ensure_future(self._round(workers_step, pending, local, delta))
        self._in_flight_shards = pending
        self._handed_back = time.perf_counter()
        return self.base, self.workers_step

    async def _blocking_round(self, workers_step: int, pending: PendingRound, local: dict, delta: dict) -> dict:
        """The round of these shards, abandoned after the bound: then its workers go on from θ_global as it is (the
        outer step they were at, unless the round had applied its step already) and the region catches up at its
        next round. A hung round (a DHT call that never returns) so costs that round, never the group: raising
        here fails every rank, a Ray Train failure, and repeated slow rounds would use up run.max_failures."""
        step_before, bound = self.outer.step_count, self._await_bound()
        round_ = asyncio.ensure_future(self._round(workers_step, pending, local, delta))
        try:
            return await asyncio.wait_for(asyncio.shield(round_), timeout=bound)
        except asyncio.TimeoutError:
            action, self._abandoned_in_a_row = policy.overdue_round(self.outer.step_count != step_before,
                                                                    self._abandoned_in_a_row)
            if action == policy.FINISH_IN_BACKGROUND:  # the next round or a restart waits for it first
                self._in_flight, self._in_flight_shards = round_, pending
                self.record_event("round_finishing_in_background", workers_step=workers_step,
                                  outer_step=self.outer.step_count)
            else:  # its batches were read: a group restarted before the next round reads on after them
                self._cancel_round(round_)
                self._take_progress(pending)
                self.record_event("round_abandoned", workers_step=workers_step, outer_step=self.outer.step_count,
                                  waited_seconds=round(bound, 1), in_a_row=self._abandoned_in_a_row)
                if action == policy.FAIL:
                    raise self._node_does_not_answer()
            with self._state_lock:
                return {name: t.clone() for name, t in self.outer.global_state().items()}

    def _node_does_not_answer(self) -> RuntimeError:
        """The error for the workers (Ray Train's failure handling) at the ABANDONED_ROUNDS_LIMIT-th round in a row."""
        return RuntimeError(f"[{self.region}] {self._abandoned_in_a_row} rounds in a row did not end within "
                            f"{self._await_bound():.0f} s: the region's Hivemind node does not answer")

    def _cancel_round(self, round_: asyncio.Future) -> None:
        """Cancel a round still running; what it still runs in an executor thread sees the new generation and
        changes nothing (`_check_current`, `_set_state`)."""
        if not round_.done():
            with self._state_lock:
                self._generation += 1
            round_.cancel()

    def _overlaps(self, delta: dict[str, torch.Tensor], notice: bool) -> bool:
        """Whether this round may run while the workers train on: `policy.may_overlap` (`notice`: a preemption
        notice stands, the workers checkpoint this round)."""
        run = self.config.run
        return policy.may_overlap(overlap=self.config.outer.overlap, reached=self.outer.step_count + 1,
                                  target=run.outer_steps, checkpoint_every=run.checkpoint_every,
                                  stopping=self.stop_requested, notice=notice,
                                  finite=not any(count_nonfinite(t) for t in delta.values()))

    async def _finish_in_flight(self) -> None:
        """Waits for the overlapped round still running, if any (every caller the same round: the ranks of a
        restarting group all call resume_state at once); its error, if it failed, is raised here. A timeout
        here leaves the round running (shielded): its outer step is still applied."""
        in_flight = self._in_flight
        if in_flight is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(in_flight), timeout=self._await_bound())
        finally:
            if in_flight.done() and self._in_flight is in_flight:
                self._in_flight = None

    def _drop_overlap_base(self) -> None:
        """The overlapped round's update will never come: the workers' Δ is taken against θ_global itself (it
        holds their progress of both windows)."""
        self.base = None
        self.workers_step = self.outer.step_count

    def _abandon_in_flight(self, in_a_row: int | None = None) -> None:
        """Cancel the round still running (overlapped, or finishing in the background): it costs that round (the
        region's Δ of it is lost, the next round re-syncs if the others moved on), counted in a row
        (`in_a_row`) where the next round waited for it (`policy.overdue_in_flight`), not where a restarting
        group did. Its batches were read: a group restarted now reads on after them (before, `resume_state` handed
        back the position before that window: it was trained twice)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and not in_flight.done():
            self._cancel_round(in_flight)
            if self._in_flight_shards is not None:
                self._take_progress(self._in_flight_shards)
            self.record_event("overlapped_round_abandoned", outer_step=self.outer.step_count,
                              waited_seconds=round(self._await_bound(), 1),
                              **({} if in_a_row is None else {"in_a_row": in_a_row}))

    async def _round(self, workers_step: int, pending: PendingRound, local: dict, delta: dict) -> dict:
        try:
            new_global = await self._run_round(workers_step, pending, local, delta)
        except Exception as error:
            if pending.overlapped:  # its workers learn of it at their next call; the event says which round
                self.record_event("overlapped_round_failed", workers_step=workers_step, error=repr(error)[:300])
            raise
        finally:
            self._round_ended = time.perf_counter()
        self._abandoned_in_a_row = 0  # a round ended: the region's Hivemind node answers
        self._take_progress(pending)
        return new_global

    def _take_progress(self, pending: PendingRound) -> None:
        """The region's data position after the window of `pending`: where a restarted group reads on from."""
        if all(pending.progress_by_rank.values()):  # every rank's (tests may leave it out)
            self.progress = region_progress(list(pending.progress_by_rank.values()))

