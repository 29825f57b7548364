"""Checkpoints of a region's SyncActor: the outer state committed beside the workers' checkpoint of the same
outer step, and the run resumed from one.

A mixin of `SyncActorImpl` (actor.py), like `rounds.py` and `membership.py`: the actor's state lives there.
The workers save first (`ray_diloco.worker.checkpoint_region`: every rank uploads through Ray Train), then rank 0
calls `commit_checkpoint`, so a committed outer checkpoint always has a complete worker checkpoint beside it. Under a
preemption notice the workers save theirs as they hand in (`ray_diloco.worker.save_at_hand_in`), and `exchange`
commits it as the round ends, whether or not the group outlived the round; so does a round in which they found the
notice as they waited (`notice_in_round`, then `late_hand_in`).
"""

from __future__ import annotations

import asyncio
import logging

from ray_diloco import metrics
from ray_diloco.checkpoint import OuterCheckpoint
from ray_diloco.sync import policy
from ray_diloco.sync.bounded import LISTING_SECONDS
from ray_diloco.sync.policy import FINISHED, UNSETTLED, StateRecord

logger = logging.getLogger("ray_diloco.sync.actor")  # the actor's log: one stream per region


class Checkpoints:
    """The checkpoint logic of `SyncActorImpl` (see the module docstring)."""

    def _resume_from_checkpoint(self, step: int) -> None:
        """`step`: the outer step the driver resumes all its regions from."""
        checkpoint = self.store.load(step)
        if checkpoint.progress is not None and "batches" not in checkpoint.progress:
            raise ValueError(f"{self.store.location(step)} holds per-worker data positions (written by a version "
                             "before region-level positions): continue it with that version, or start a new run")
        self._set_state(checkpoint.outer_step, checkpoint.theta, checkpoint.momentum)
        if self.compressor is not None:  # the region's own error feedback / momentum, exactly as it was
            self.compressor.load_state_dict(checkpoint.method_state)
        self.progress, self.tokens = checkpoint.progress, checkpoint.tokens
        self.short_tokens = checkpoint.short_tokens
        self.committed = (checkpoint.outer_step, checkpoint.worker_checkpoint)
        self.record_event("resumed", checkpoint=self.store.location(checkpoint.outer_step), digest=self._digest)

    def _commit_bound(self) -> float:
        """How long a commit may take: the state's size at the slowest link the run allows, and a listing."""
        return self._download_seconds() + LISTING_SECONDS

    async def commit_checkpoint(self, outer_step: int, worker_checkpoint: str) -> str | None:
        """Called by rank 0 once every rank has uploaded its worker checkpoint of `outer_step` (or by `exchange`
        with the one they saved as they handed in under a notice, named after the step handed in): saves θ_global,
        momentum, outer step and data progress, marked complete last. Returns the checkpoint's location (None:
        not committed, event checkpoint_failed)."""
        if outer_step != self.outer.step_count:
            raise RuntimeError(f"[{self.region}] commit of outer step {outer_step}, but the outer state is at "
                               f"step {self.outer.step_count}")
        (step, theta, momentum), digest = self._snapshot(), self._digest  # no await between: one state
        momentum_digest = self._momentum_digest
        method_state = self.compressor.state_dict() if self.compressor is not None else {}
        checkpoint = OuterCheckpoint(outer_step=step, theta=theta, momentum=momentum, progress=self.progress,
                                     worker_checkpoint=worker_checkpoint, tokens=self.tokens,
                                     short_tokens=self.short_tokens,
                                     config_yaml=self.config.to_yaml(), method_state=method_state)
        # Off the event loop: other regions' calls (state sharing) go on while the files are written. Bounded by
        # the state's size at the slowest link the run allows: a hung bucket costs this checkpoint (the region
        # goes on; the last committed one stays the latest), never the group.
        bound = self._commit_bound()
        self._committing = committing = asyncio.Event()  # a restarting group waits for it (resume_state)
        try:
            location = await asyncio.get_running_loop().run_in_executor(
                None, self._storage.call, "checkpoint", lambda: self.store.save(checkpoint), bound)
        except Exception as error:
            self.record_event("checkpoint_failed", outer_step=step, error=repr(error)[:300])
            return None
        else:
            self.committed = (step, worker_checkpoint)
        finally:
            committing.set()
            if self._committing is committing:
                self._committing = None
        # A region starting after our driver is gone can join from it; never over our final record (a checkpoint
        # of the last step comes after the region finished).
        if self.sharer is not None and self._published.phase not in (FINISHED, UNSETTLED):
            record = StateRecord(self.region, step, digest, 0, momentum_digest=momentum_digest)
            await asyncio.get_running_loop().run_in_executor(None, self._keep_in_storage, record, location)
        metrics.safely(metrics.record_checkpoint, self.config.run.name, self.region, outer_step=step)
        logger.info("[%s] checkpoint of outer step %d committed: %s", self.region, step, location)
        return location

    # -- the workers' hand-in checkpoint under a preemption notice ------------------------------------------------
    async def _commit_hand_in(self, pending) -> None:
        """Commit the checkpoint the workers saved as they handed in under a preemption notice (or as they waited in
        the round) with the state their round reached, where `policy.commits_hand_in_checkpoint` says so. Where not,
        the workers checkpoint after the round themselves (they ask `committed_checkpoint`)."""
        if pending.hand_in_checkpoint and policy.commits_hand_in_checkpoint(
                pending.round_from, pending.reached, pending.overlapped,
                in_background=self._in_flight_shards is pending):
            await self._commit_worker_checkpoint(pending.reached, pending.hand_in_checkpoint)

    async def _commit_worker_checkpoint(self, outer_step: int, location: str) -> bool:
        """`commit_checkpoint`, where a failure (the bucket's, or the state moved on meanwhile) costs the
        checkpoint, an event, never the round. Returns whether it was committed."""
        try:
            return await self.commit_checkpoint(outer_step, location) is not None
        except Exception as error:  # noqa: BLE001 — see the docstring
            self.record_event("checkpoint_failed", outer_step=outer_step, error=repr(error)[:300])
            return False

    def notice_in_round(self, outer_step: int) -> bool:
        """A preemption notice came while the workers wait in their round of `outer_step` (worker.wait_for_round),
        told before they save: a round not yet scheduled (it waits for the round in flight) then blocks, so the state
        it reaches is θ_global and can be checkpointed. Returns whether the round had not ended (been answered);
        where it had, the workers go on as if they had not looked (their next look finds the notice again): the round
        may have overlapped, and its state cannot be checkpointed."""
        pending = self._rounds.get(outer_step)
        if pending is None:
            return False
        pending.notice = True
        return True

    async def late_hand_in(self, outer_step: int, hand_in_checkpoint: str) -> bool:
        """The workers' hand-in checkpoint for their round of `outer_step`, saved after `notice_in_round`. A round
        still running commits it as it ends, as one given with the hand-in (`_commit_hand_in`). A round that ended
        meanwhile ran blocking (the notice came first): committed now, where the policy allows and the state is
        still the one it reached. Returns whether it was taken (a commit as the round ends may still fail)."""
        pending = self._rounds.get(outer_step)
        if pending is not None:
            pending.hand_in_checkpoint = hand_in_checkpoint
            return True
        if self._last_blocking_round is None:
            return False
        step, round_from, reached = self._last_blocking_round
        if step != outer_step or self.outer.step_count != reached or not policy.commits_hand_in_checkpoint(
                round_from, reached):
            return False
        return await self._commit_worker_checkpoint(reached, hand_in_checkpoint)

    def committed_checkpoint(self) -> tuple[int, str] | None:
        """(outer step, worker checkpoint) of the last commit: whether a round committed the workers' hand-in one."""
        return self.committed
