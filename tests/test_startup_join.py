"""A region's SyncActor starting for a resumed run: what it joins before its workers start.

The driver starts its regions' SyncActors side by side, the others joining the first once it is up; the first reads
the regions' records before the others have published, so the run's storage supplies their stored ones — from their
earlier life, when the run is resumed. Real SyncActor, Hivemind, checkpoint store and stored records (no Ray).
"""

from __future__ import annotations

import pytest
import torch

from ray_diloco.sync.actor import SyncActorImpl
from ray_diloco.sync.outer import state_digest
from test_sync_actor import MM, config


@pytest.mark.parametrize("ahead_step, phase", [(2, "training"), (4, "finished")])  # a commit, a final state
def test_a_resumed_region_never_joins_what_a_region_of_its_own_driver_stored_before(tmp_path, ahead_step, phase):
    """A killed run's r1 had committed step 2 and r0 only step 1, so the run resumes both from step 1. r0's actor
    starts first and reads the stored records before r1 publishes: r1's (step 2, its earlier life's) must not be
    joined — r0 took it and skipped a round whose windows it then trained again. Where r1 runs in another cluster
    (run.local_regions: r0 alone), its stored state is the run's, and r0 joins it (a late region). Both for a
    committed step and a final state (stored final records also reach every read of the records)."""
    from ray_diloco.checkpoint import CheckpointStore, OuterCheckpoint, join
    from ray_diloco.config import ExperimentConfig
    from ray_diloco.model import build_model, parameter_state
    from ray_diloco.sync import durable
    from ray_diloco.sync.policy import StateRecord

    cfg = config(tmp_path, "stale", [1, 1], matchmaking_seconds=MM, outer_steps=4, checkpoint_every=1)
    run, model = ExperimentConfig.from_dict(cfg).run, ExperimentConfig.from_dict(cfg).model
    initial = parameter_state(build_model(model, model.vocab_size, cfg["data"]["seq_len"], run.seed))

    def moved(seed):
        g = torch.Generator().manual_seed(seed)
        return {name: t + 1e-3 * torch.randn(t.shape, generator=g) for name, t in initial.items()}

    CheckpointStore(join(run.checkpoint_root(), "r0")).save(OuterCheckpoint(outer_step=1, theta=moved(1), momentum={}))
    ahead = moved(2)
    momentum = {name: torch.zeros_like(t) for name, t in ahead.items()}
    location = CheckpointStore(join(run.checkpoint_root(), "r1")).save(
        OuterCheckpoint(outer_step=ahead_step, theta=ahead, momentum=momentum))
    record = StateRecord("r1", ahead_step, state_digest(ahead), 2, phase, momentum_digest=state_digest(momentum))
    durable.write_record(run.states_dir(), durable.StoredRecord(record, location))

    for local_regions, expected in (([], 1), (["r0"], ahead_step)):
        actor = SyncActorImpl({**cfg, "run": {**cfg["run"], "local_regions": local_regions}}, "r0", resume_step=1)
        try:
            step, joined = actor.outer.step_count, [e for e in actor.events if e["event"] == "region_joined"]
        finally:
            actor.shutdown()
        assert step == expected, (local_regions, actor.events)
        assert len(joined) == (expected == ahead_step), actor.events
