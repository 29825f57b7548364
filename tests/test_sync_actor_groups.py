"""The SyncActor (ray_diloco.sync.actor.SyncActorImpl, tested as a plain class) and the region's worker group:
the handshake of a (re)starting group is one state, a restart drops a dead rank's shards, a group of another size
is a resize that continues from the region's position, and a group restarted while the dying group's commit is
still written waits for it. The actor's rounds, re-syncs and faults are in tests/test_sync_actor.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from ray_diloco.sync.actor import SyncActorImpl
from test_sync_actor import MM, config, trained


def halves(actor: SyncActorImpl, seed: int) -> list[dict[str, torch.Tensor]]:
    """Two ranks' shards (dim-0 halves, as FSDP2 with 2 workers) of a slightly trained θ."""
    from ray_diloco.sharding import rows_for_rank

    full = trained(actor, seed)
    return [rows_for_rank(full, 2, rank) for rank in range(2)]


def test_the_worker_handshake_is_one_state_and_restarts_drop_a_dead_ranks_shards(tmp_path):
    """A restarted group gets (outer step, rows, data position, checkpoint) in one call; shards a rank of the
    old group left in a round are dropped (their waiter gets an error, never a hang); a step that does not match
    the actor's is refused."""
    cfg = config(tmp_path, "handshake", [2])
    actor = SyncActorImpl(cfg, "r0")
    for rank, pid in ((0, 100), (1, 101)):
        actor.register_worker(rank, 2, pid, "host")

    async def scenario():
        old_rank0 = asyncio.ensure_future(actor.exchange(0, 0, 2, halves(actor, 1)[0], tokens=10))
        await asyncio.sleep(0.1)  # rank 1 of the old group died before sending its shards
        actor.register_worker(0, 2, 200, "host")  # the group restarts
        with pytest.raises(RuntimeError, match="dropped: rank 0 of the region restarted"):
            await old_rank0
        state = await actor.resume_state(1, 2)
        assert state["outer_step"] == 0 and state["worker_checkpoint"] is None
        new = halves(actor, 2)
        return state, await asyncio.gather(actor.exchange(0, 0, 2, new[0], tokens=10),
                                           actor.exchange(0, 1, 2, new[1], tokens=10))

    state, results = asyncio.run(scenario())
    assert set(state["rows"]) == set(actor.shapes)  # rank 1's rows of every parameter
    assert [step for step, _, _ in results] == [1, 1] and actor.tokens == 20  # the new ranks' round only
    with pytest.raises(RuntimeError, match="exchanges outer step 0, but the region's workers should be at step 1"):
        asyncio.run(actor.exchange(0, 0, 2, halves(actor, 3)[0], tokens=10))


def test_a_group_of_another_size_is_a_resize_and_continues_from_the_regions_position(tmp_path):
    """Ray Train restarts an elastic region's group with 1 worker after a round of 2: the actor records
    `group_resized` (2 -> 1, at the outer step), hands the new rank 0 every row, and the region's data position
    (both old ranks' windows), refuses a late call of the old group, and a round of 1 goes on from there."""
    cfg = config(tmp_path, "resize", [2])
    actor = SyncActorImpl(cfg, "r0")
    for rank, pid in ((0, 100), (1, 101)):
        actor.register_worker(rank, 2, pid, "host", node=f"node-{rank}")
    start = {"batches": 0, "epoch": 0, "epoch_batches": 0, "windows": 0, "fingerprint": "0" * 16}
    progress = [{"batches": 3 + rank, "epoch": 0, "epoch_batches": 3 + rank, "windows": 2 * 4,
                 "fingerprint": f"{rank + 1:016x}", "start": start} for rank in range(2)]

    async def round_of_two():
        shards = halves(actor, 1)
        return await asyncio.gather(*(actor.exchange(0, rank, 2, shards[rank], 10, progress[rank])
                                      for rank in range(2)))

    asyncio.run(round_of_two())
    actor.register_worker(0, 1, 300, "host", node="node-2")  # on a node the autoscaler started meanwhile
    assert actor.stats()["worker_nodes"] == ["node-0", "node-1", "node-2"]  # every node, in order of first use
    (resized,) = [e for e in actor.events if e["event"] == "group_resized"]
    assert (resized["from_workers"], resized["to_workers"], resized["outer_step"]) == (2, 1, 1)
    state = asyncio.run(actor.resume_state(0, 1))
    assert all(state["rows"][name].shape == shape for name, shape in actor.shapes.items())  # every row
    assert state["progress"] == {"batches": 4, "epoch": 0, "epoch_batches": 4, "windows": 16,
                                 "fingerprint": f"{3:016x}"}
    assert actor.worker_pids() == {0: 300}  # rank 1 of the old group is gone
    with pytest.raises(RuntimeError, match="of a group of 2 exchanges, but the region's group has 1 workers now"):
        asyncio.run(actor.exchange(1, 1, 2, halves(actor, 3)[1], 10, progress[1]))  # a late rank of the old group
    rank0 = {**progress[0], "start": state["progress"]}
    step, _, _ = asyncio.run(actor.exchange(1, 0, 1, trained(actor, 2), 10, rank0))
    assert step == 2
    actor.register_worker(0, 1, 301, "host", node="node-1")  # restarted on a node it had used before: listed once
    assert actor.stats()["worker_nodes"] == ["node-0", "node-1", "node-2"]


def test_a_restarted_group_waits_for_the_dying_groups_commit_and_loads_that_checkpoint(tmp_path):
    """A group restarted while its predecessor's commit is still being written (a slow bucket) must wait for it:
    answered before, it found no worker checkpoint of the step, started AdamW anew and, where it had to checkpoint
    the step itself (a stop), committed the step a second time over the first."""
    actor = SyncActorImpl(config(tmp_path, "commit-wait", [1], outer_steps=3, matchmaking_seconds=MM), "r0")
    save = actor.store.save

    def slow_save(checkpoint):
        time.sleep(1.5)  # the bucket takes its time; the restart's call comes meanwhile
        return save(checkpoint)

    try:
        async def commit_then_restart():
            await actor.exchange(0, 0, 1, trained(actor, 30), tokens=1000)
            actor.store.save = slow_save
            commit = asyncio.create_task(actor.commit_checkpoint(1, "worker-checkpoint-1"))
            await asyncio.sleep(0.3)  # the commit is under way
            point = await actor.resume_state(0, 1)
            return point, commit.done(), await commit

        point, commit_done_first, location = asyncio.run(commit_then_restart())
    finally:
        actor.shutdown()
    assert location is not None and commit_done_first
    assert (point["outer_step"], point["worker_checkpoint"]) == (1, "worker-checkpoint-1"), point
    assert actor.store.steps() == [1]


def test_a_hand_in_checkpoint_is_committed_as_its_round_ends_and_a_group_restarted_in_the_round_loads_it(tmp_path):
    """Under a preemption notice the workers save their part of the checkpoint as they hand in; the round may end
    after the deadline, with the group gone. The SyncActor commits that checkpoint with the round's state before it
    answers, so the group Ray Train starts meanwhile (it waits in resume_state for the round) continues from it,
    AdamW included. A round without one commits nothing (the workers checkpoint after it, where they do)."""
    actor = SyncActorImpl(config(tmp_path, "hand-in", [1], outer_steps=3, matchmaking_seconds=MM), "r0")
    actor.register_worker(0, 1, 100, "host")
    save = actor.store.save

    def slow_save(checkpoint):
        time.sleep(1.0)  # the bucket takes its time: the restarted group asks meanwhile
        return save(checkpoint)

    try:
        async def rounds():
            await actor.exchange(0, 0, 1, trained(actor, 40), tokens=1000)  # no notice: no commit
            committed_before = actor.store.steps()
            actor.store.save = slow_save
            round_ = asyncio.ensure_future(actor.exchange(1, 0, 1, trained(actor, 41), tokens=400, notice=True,
                                                          hand_in_checkpoint="hand-in-of-2"))
            await asyncio.sleep(0.3)  # the round and its commit are under way; the deadline ends the group
            actor.register_worker(0, 1, 200, "host")
            point = await actor.resume_state(0, 1)
            return committed_before, point, await round_

        committed_before, point, (reached, _, stop) = asyncio.run(rounds())
    finally:
        actor.shutdown()
    assert committed_before == []
    assert reached == 2 and not stop
    assert (point["outer_step"], point["worker_checkpoint"]) == (2, "hand-in-of-2"), point
    assert actor.committed_checkpoint() == (2, "hand-in-of-2")  # what the workers ask after the round
    assert actor.store.steps() == [2]
    saved = actor.store.load(2)
    assert saved.worker_checkpoint == "hand-in-of-2" and saved.outer_step == 2
    assert all(torch.equal(saved.theta[name], value) for name, value in actor.global_state().items())


def test_a_hand_in_checkpoint_that_cannot_be_committed_costs_the_checkpoint_not_the_round(tmp_path):
    """The bucket fails as the SyncActor commits the workers' hand-in checkpoint: the round still ends for every
    rank, the failure is an event, and the workers, asking what was committed, see it was not (they checkpoint after
    the round themselves)."""
    actor = SyncActorImpl(config(tmp_path, "hand-in-fails", [1], outer_steps=3, matchmaking_seconds=MM), "r0")
    actor.register_worker(0, 1, 100, "host")

    def failing_save(checkpoint):
        raise OSError("the bucket is gone")

    actor.store.save = failing_save
    try:
        reached, _, stop = asyncio.run(actor.exchange(0, 0, 1, trained(actor, 42), tokens=400, notice=True,
                                                      hand_in_checkpoint="hand-in-of-1"))
    finally:
        actor.shutdown()
    assert reached == 1 and not stop
    assert actor.committed_checkpoint() is None
    assert [e["outer_step"] for e in actor.events if e["event"] == "checkpoint_failed"] == [1]


def test_a_checkpoint_saved_while_the_round_waits_is_committed_for_that_round_and_only_for_it(tmp_path):
    """A preemption notice comes while the workers wait in their round (worker.wait_for_round): they tell the
    SyncActor (`notice_in_round`), save their hand-in checkpoint, and offer it (`late_hand_in`). Rounds take a second
    here (the other regions are late). With outer.overlap:
    - step 1's hand-in waits for round 0 in flight when the notice comes: its round blocks instead of overlapping
      (one under a notice is checkpointed) and commits the checkpoint as it ends, with the step it reached;
    - step 3's hand-in (the run's last round, blocking) is told of a notice as it waits for round 2 in flight, and
      the round ends while the workers save: the checkpoint offered after it is committed then (the state is still
      the one that round reached);
    - told of a notice after its round was answered (rounds 0 and 2, overlapped), or offered a checkpoint for a round
      whose state has moved on, the SyncActor refuses: the workers go on, or checkpoint after the round themselves."""
    cfg = config(tmp_path, "late-hand-in", [1], outer_steps=4, matchmaking_seconds=MM)
    cfg["outer"]["overlap"] = True
    actor = SyncActorImpl(cfg, "r0")
    actor.register_worker(0, 1, 100, "host")
    run_round = actor._run_round

    async def late_round(*args):
        await asyncio.sleep(1.0)
        return await run_round(*args)

    actor._run_round = late_round
    try:
        async def rounds():
            answered_at_once = (await actor.exchange(0, 0, 1, trained(actor, 43), tokens=1000))[0]  # overlapped
            second = asyncio.ensure_future(actor.exchange(1, 0, 1, trained(actor, 44), tokens=1000))
            await asyncio.sleep(0.3)  # the hand-in of step 1 waits for round 0; the notice comes now
            told = {0: actor.notice_in_round(0), 1: actor.notice_in_round(1)}
            taken = {1: await actor.late_hand_in(1, "saved-in-round-1")}
            committed = {"round 0": actor.committed_checkpoint()}
            reached = [(await second)[0]]
            reached.append((await actor.exchange(2, 0, 1, trained(actor, 45), tokens=1000))[0])  # overlapped
            told[2] = actor.notice_in_round(2)  # answered already: the workers go on (their next look finds it)
            last = asyncio.ensure_future(actor.exchange(3, 0, 1, trained(actor, 46), tokens=1000))
            await asyncio.sleep(0.3)  # it waits for round 2 in flight, then runs blocking (the run's last)
            told[3] = actor.notice_in_round(3)
            committed["round 2"] = actor.committed_checkpoint()
            reached.append((await last)[0])  # the round ends while the workers save
            taken[3] = await actor.late_hand_in(3, "saved-as-round-3-ended")
            taken["1 again"] = await actor.late_hand_in(1, "saved-after-round-1")  # the state is at step 4 now
            return answered_at_once, told, taken, committed, reached

        answered_at_once, told, taken, committed, reached = asyncio.run(rounds())
    finally:
        actor.shutdown()
    assert answered_at_once == 1 and told == {0: False, 1: True, 2: False, 3: True}
    assert taken == {1: True, 3: True, "1 again": False}
    assert committed == {"round 0": None, "round 2": (2, "saved-in-round-1")}
    assert reached == [2, 3, 4] and [r["overlapped"] for r in actor.history] == [True, False, True, False]
    assert actor.committed_checkpoint() == (4, "saved-as-round-3-ended")
    assert actor.store.steps() == [2, 4] and actor.store.load(4).worker_checkpoint == "saved-as-round-3-ended"


def test_a_checkpoint_offered_after_its_round_that_the_bucket_refuses_is_not_taken(tmp_path):
    """A notice came as the workers waited in the run's last round, which ended while they saved: the checkpoint
    they offer after it is committed then (`late_hand_in`). Where the bucket refuses that commit, the SyncActor must
    answer "not taken": the workers' `saved_in_round` event said "taken" (their own check of the commit, and the
    checkpoint every round under a notice has, still saved the round's state)."""
    actor = SyncActorImpl(config(tmp_path, "late-refused", [1], outer_steps=1, matchmaking_seconds=MM), "r0")
    actor.register_worker(0, 1, 100, "host")

    def failing_save(checkpoint):
        raise OSError("the bucket is gone")

    try:
        async def round_then_offer():
            last = asyncio.ensure_future(actor.exchange(0, 0, 1, trained(actor, 47), tokens=1000))
            await asyncio.sleep(0)  # the hand-in is under way when the notice comes
            told = actor.notice_in_round(0)
            reached = (await last)[0]  # the round ends while the workers save
            actor.store.save = failing_save
            return told, reached, await actor.late_hand_in(0, "saved-as-round-0-ended")

        told, reached, taken = asyncio.run(round_then_offer())
    finally:
        actor.shutdown()
    assert (told, reached) == (True, 1)
    assert taken is False
    assert actor.committed_checkpoint() is None
    assert [e["outer_step"] for e in actor.events if e["event"] == "checkpoint_failed"] == [1]
