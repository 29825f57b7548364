"""Checkpoints of a region's SyncActor: the outer state committed beside the workers' checkpoint of the same
outer step, and the run resumed from one.

A mixin of `SyncActorImpl` (actor.py), like `rounds.py` and `membership.py`: the actor's state lives there.
The workers save first (`ray_diloco.worker.checkpoint_region`: every rank uploads through Ray Train), then rank 0
calls `commit_checkpoint`, so a committed outer checkpoint always has a complete worker checkpoint beside it.
"""

from __future__ import annotations

import asyncio
import logging

from ray_diloco import metrics
from ray_diloco.checkpoint import OuterCheckpoint
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

    async def commit_checkpoint(self, outer_step: int, worker_checkpoint: str) -> str | None:
        """Called by rank 0 once every rank has uploaded its worker checkpoint of `outer_step`: saves θ_global,
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
        bound = self._download_seconds() + LISTING_SECONDS
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
