"""The SyncActor (ray_diloco.sync.actor.SyncActorImpl, tested as a plain class) when a region's Δ is NaN/inf.

Two regions in this process on 127.0.0.1 (real DHTs, averagers and state sharing), one worker each. Checks that:
* a region whose pseudo-gradient has non-finite values sends nothing: the other region's round goes alone
  (group_size 1) after matchmaking; the bad region records `nonfinite_pseudo_gradient` with the count, re-syncs
  (`resync`) to the good region's state and hands its worker that θ (bit-identical digest) and outer step;
* a single region with a non-finite Δ has nobody to re-sync from and stops with a clear error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import small_run
from ray_diloco.config import ExperimentConfig
from ray_diloco.evaluator import EvaluatorImpl
from ray_diloco.outcome import TrainingOutcome, eval_curve
from ray_diloco.sharding import from_wire
from ray_diloco.sync.outer import state_digest
from ray_diloco.sync.actor import SyncActorImpl

MM = 2.0  # matchmaking_seconds: the good region waits this long for the bad one before going alone


def config(tmp_path, name: str, workers: list[int], **kwargs) -> dict:
    # The preset's data: these rounds declare 1000 tokens, more than a window of TEST_DATA's holds (a declared
    # weight above the run's bound is refused: ExperimentConfig.max_round_tokens).
    cfg = small_run(tmp_path, name, workers=workers, data={}, **kwargs)
    # The driver sets the vocabulary from the tokenizer; a small one keeps the model tiny.
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=256)).to_dict()


def trained(actor: SyncActorImpl, seed: int) -> dict[str, torch.Tensor]:
    """θ_global moved a little, as H inner steps would (one worker: the shard is the whole tensor)."""
    g = torch.Generator().manual_seed(seed)
    return {name: t + 1e-3 * torch.randn(t.shape, generator=g) for name, t in actor.global_state().items()}


def nonfinite_events(actor: SyncActorImpl) -> list[dict]:
    return [e for e in actor.events if e["event"] == "nonfinite_pseudo_gradient"]


def test_region_with_nonfinite_delta_sits_out_and_resyncs_to_the_other(tmp_path):
    cfg = config(tmp_path, "nonfinite", [1, 1], matchmaking_seconds=MM)
    good = SyncActorImpl(cfg, "r0")
    bad = None
    try:
        bad = SyncActorImpl(cfg, "r1", initial_peers=good.multiaddrs())
        good_shards, bad_shards = trained(good, seed=1), trained(bad, seed=2)
        name = next(iter(bad_shards))
        bad_shards[name].view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])

        async def both():
            return await asyncio.gather(good.exchange(0, 0, 1, good_shards, tokens=1000),
                                        bad.exchange(0, 0, 1, bad_shards, tokens=1000))

        (good_step, good_rows, good_stop), (bad_step, bad_rows, bad_stop) = asyncio.run(both())
        good_rows, bad_rows = from_wire(good_rows), from_wire(bad_rows)
    finally:
        for actor in (bad, good):
            if actor is not None:
                actor.shutdown()

    assert good.last_round()["group_size"] == 1 and good.last_round()["peers"] == ["r0"]
    assert not good_stop and not bad_stop  # nobody asked the run to stop
    assert good_step == bad_step == 1 == bad.outer_step()
    assert bad.digest() == good.digest() == state_digest(bad_rows) == state_digest(good_rows)
    assert all(torch.isfinite(t).all() for t in bad_rows.values())
    assert [e["bad_values"] for e in nonfinite_events(bad)] == [3] and not nonfinite_events(good)
    resync = [e for e in bad.events if e["event"] == "resync"]
    assert len(resync) == 1 and resync[0]["source"] == "r0" and resync[0]["to_step"] == 1
    assert bad.last_round()["group_size"] == 0 and bad.last_round()["nonfinite_values"] == 3


def test_single_region_with_nonfinite_delta_stops_with_a_clear_error(tmp_path):
    cfg = config(tmp_path, "nonfinite-alone", [1])
    alone = SyncActorImpl(cfg, "r0")
    shards = trained(alone, seed=3)
    next(iter(shards.values())).view(-1)[0] = float("nan")
    with pytest.raises(RuntimeError, match="region r0: pseudo-gradient has 1 non-finite values and no other"):
        asyncio.run(alone.exchange(0, 0, 1, shards, tokens=1000))
    assert alone.outer_step() == 0 and [e["bad_values"] for e in nonfinite_events(alone)] == [1]


def test_a_region_resumed_from_an_older_checkpoint_catches_up_when_the_driver_asks(tmp_path):
    """A region that left early resumes from its own older checkpoint; `catch_up` (called by the driver once
    every actor runs, whatever the start order) gives it its peers' newer state before its workers start."""
    cfg = config(tmp_path, "catch-up", [1, 1], matchmaking_seconds=MM)
    behind = SyncActorImpl(cfg, "r0")  # starts first: nobody to join yet
    ahead = None
    try:
        ahead = SyncActorImpl(cfg, "r1", initial_peers=behind.multiaddrs())
        theta = trained(ahead, seed=4)
        ahead._set_state(5, theta, {})  # as if resumed from its checkpoint of outer step 5
        ahead.catch_up()  # publishes its state
        assert behind.outer_step() == 0
        assert behind.catch_up() == 5
    finally:
        for actor in (ahead, behind):
            if actor is not None:
                actor.shutdown()
    assert behind.digest() == ahead.digest() == state_digest(theta)
    assert [e["event"] for e in behind.events if e["event"] not in ("hivemind_started", "peer_connected")] == [
        "region_joined"]


def test_two_diverged_regions_agree_on_one_state_instead_of_swapping(tmp_path):
    """Both regions alone in a round (one was later than the matchmaking window), same step, different θ: before
    the next round both must adopt the same canonical state. Each used to vote with group size 0 against the
    other's published 1, so each adopted the other's state, and they swapped again after every round.

    Exactly one region adopts per round. Where the all-reduce of the round after fails (once in a full CI run: a
    sender's stream stalled for averaging_timeout, each region applied its own Δ, both published an inconsistent
    round), the regions have diverged again and the protocol's answer is the same adoption before the next round:
    the test runs that round too, and the same rule must hold there."""
    # Both are ready at once and the group fills at once: a long matchmaking window costs nothing here. With MM's
    # 2 s (hivemind's request timeout then 1 s: min(3, MM / 2)), a loaded machine once failed this round part-way
    # ("a reducer failed: 230400 of 428672 values were not averaged") and the check saw no common state.
    cfg = config(tmp_path, "swap", [1, 1], matchmaking_seconds=15.0, outer_steps=8)
    a = SyncActorImpl(cfg, "r0")
    b = None
    try:
        b = SyncActorImpl(cfg, "r1", initial_peers=a.multiaddrs())
        for actor, seed in ((a, 5), (b, 6)):  # each went alone through round 4 (group of 1)
            actor._set_state(5, trained(actor, seed), {})
            actor._publish(group_size=1)
        assert a.digest() != b.digest()

        async def round_at(step: int, seed: int):
            return await asyncio.gather(a.exchange(step, 0, 1, trained(a, seed), tokens=1000),
                                        b.exchange(step, 0, 1, trained(b, seed + 1), tokens=1000))

        ran = []
        for step, seed in ((5, 7), (6, 9)):
            asyncio.run(round_at(step, seed))
            ran.append(step)
            rounds = [a.last_round(), b.last_round()]
            if [r["group_size"] for r in rounds] == [2, 2] and all(r["consistent"] for r in rounds):
                break
        agreed = a.digest() == b.digest()
        events = a.events + b.events
    finally:
        for actor in (b, a):
            if actor is not None:
                actor.shutdown()
    assert agreed, "the regions swapped states instead of agreeing"
    assert [r["group_size"] for r in rounds] == [2, 2] and all(r["consistent"] for r in rounds), rounds
    resyncs = sorted(e["outer_step"] for e in events if e["event"] == "resync")
    assert resyncs == ran, (resyncs, ran)  # exactly one adopted before each round


def test_a_region_late_for_the_last_round_ends_at_t_with_the_others_state(tmp_path):
    """The other region went alone through the last round and finished at T; the late one re-syncs to T and must
    not run a round of its own past T (it used to apply its stale Δ alone and end at T+1, diverged)."""
    cfg = config(tmp_path, "overshoot", [1, 1], matchmaking_seconds=MM, outer_steps=3)
    done = SyncActorImpl(cfg, "r0")
    late = None
    try:
        late = SyncActorImpl(cfg, "r1", initial_peers=done.multiaddrs())
        done._set_state(3, trained(done, 7), {})
        done._publish(group_size=1)
        late._set_state(2, trained(late, 8), {})
        late._publish(group_size=2)
        step, rows, _ = asyncio.run(late.exchange(2, 0, 1, trained(late, 9), tokens=1000))
    finally:
        for actor in (late, done):
            if actor is not None:
                actor.shutdown()
    assert step == late.outer_step() == 3
    assert late.digest() == done.digest() == state_digest(from_wire(rows))
    assert [e["event"] for e in late.events][-2:] == ["resync", "round_skipped_at_end"]


def test_a_dht_timeout_around_a_round_is_an_event_not_the_end_of_the_region(tmp_path):
    """Reading the records and publishing time out for region a (a DHT that does not answer): nobody can see it
    ready, so after outer.max_wait_seconds each region goes alone; a's round still completes, θ, tokens and
    history move together, the outage is one event (not one per poll), b counts a absent, and a's new record is
    kept for the sharer's refresher to store again."""
    cfg = config(tmp_path, "dht-timeout", [1, 1], matchmaking_seconds=MM)
    cfg["outer"]["max_wait_seconds"] = 4.0
    a = SyncActorImpl(cfg, "r0")
    b = None
    try:
        b = SyncActorImpl(cfg, "r1", initial_peers=a.multiaddrs())
        store = a.sharer._store_locked

        def fail(*args, **kwargs):
            raise TimeoutError("the DHT did not answer")

        a.sharer.records = fail
        a.sharer._store_locked = fail

        async def both():
            return await asyncio.gather(a.exchange(0, 0, 1, trained(a, 10), tokens=1000),
                                        b.exchange(0, 0, 1, trained(b, 11), tokens=1000))

        (step_a, _, _), (step_b, _, _) = asyncio.run(both())
        a.sharer._store_locked = store
        kept = a.sharer._record
    finally:
        for actor in (b, a):
            if actor is not None:
                actor.shutdown()
    assert step_a == step_b == 1
    assert a.last_round()["group_size"] == 1 and a.tokens == 1000 and len(a.history) == 1
    assert [e["during"] for e in a.events if e["event"] == "dht_error"] == [
        "reading state records", "publishing phase ready", "publishing the state record"]
    assert [e["regions"] for e in b.events if e["event"] == "regions_absent"] == [["r0"]]
    assert kept.outer_step == 1  # kept: the refresher stores it again


def test_an_overlapped_round_past_its_bound_is_abandoned_not_applied_under_a_restarted_group(tmp_path):
    """issue 22 item 4: resume_state swallowed the TimeoutError of the round in flight and handed out θ_global while
    that round kept running (its outer step could land under the new group). It is cancelled now, and said."""
    actor = SyncActorImpl(config(tmp_path, "abandon", [1]), "r0")  # one region: no Hivemind needed
    try:
        async def restart_during_a_stuck_round():
            stuck = asyncio.ensure_future(asyncio.sleep(3600))  # a round that does not end in time
            actor._in_flight = stuck
            actor._await_bound = lambda: 0.2
            point = await actor.resume_state(0, 1)
            await asyncio.sleep(0)  # let the cancellation land
            return stuck, point

        stuck, point = asyncio.run(restart_during_a_stuck_round())
    finally:
        actor.shutdown()
    assert stuck.cancelled() and actor._in_flight is None
    assert point["outer_step"] == 0
    assert [e["event"] for e in actor.events if e["event"] == "overlapped_round_abandoned"] == [
        "overlapped_round_abandoned"]


def test_a_finished_region_does_not_settle_again(tmp_path):
    """issue 22 item 4: a region that re-synced to the end during an overlapped round settled and published
    FINISHED; the blocking last call then settled again and could take another state after saying it was final."""
    from ray_diloco.sync.policy import FINISHED, StateRecord

    cfg = config(tmp_path, "settled-once", [1, 1], outer_steps=1, matchmaking_seconds=1.0)
    cfg["outer"].update(max_wait_seconds=1.0, averaging_timeout=2.0)
    actor = SyncActorImpl(cfg, "r0")
    try:
        actor.outer.step_count = 1
        actor._published = StateRecord("r0", 1, actor.digest(), 2, FINISHED)
        # The other's digest wins the canonical vote's tie-break (the smallest): the old code would take it.
        actor._read_records = lambda: [actor._published, StateRecord("r1", 1, "0" * 32, 2, FINISHED)]
        actor._settle_at_end()
    finally:
        actor.shutdown()
    assert actor.digest() == actor._published.digest
    assert not [e for e in actor.events if e["event"].startswith("settled_at_end")], actor.events


def test_a_stuck_overlapped_round_costs_that_round_not_the_group(tmp_path):
    """issue 22 item 4: at the next exchange, the overlapped round still in flight past its bound raised a
    TimeoutError to every rank (a Ray Train failure: repeated slow rounds used up max_failures). It is abandoned
    now; the workers' Δ covers both windows, taken against θ_global itself, and the round goes on."""
    actor = SyncActorImpl(config(tmp_path, "stuck", [1]), "r0")  # one region: no Hivemind needed
    try:
        before = {name: t.clone() for name, t in actor.global_state().items()}

        async def exchange_while_a_round_is_stuck():
            actor._in_flight = asyncio.ensure_future(asyncio.sleep(3600))
            actor.base, actor.workers_step = dict(before), 1  # the workers were told step 1, one round ahead
            actor._await_bound = lambda: 0.2
            return await actor.exchange(1, 0, 1, trained(actor, 7), tokens=1000)

        reached, rows, stop = asyncio.run(exchange_while_a_round_is_stuck())
    finally:
        actor.shutdown()
    assert reached == 1 and not stop and actor.outer.step_count == 1
    assert [e["event"] for e in actor.events].count("overlapped_round_abandoned") == 1
    assert any(not torch.equal(before[n], t) for n, t in actor.global_state().items())  # the round was applied


def test_an_abandoned_rounds_thread_cannot_change_the_state(tmp_path):
    """An abandoned round's executor threads run on (cancelling the coroutine does not stop them): a load that
    lands after the abandonment is refused under the state lock."""
    from ray_diloco.sync.membership import RoundAbandoned

    actor = SyncActorImpl(config(tmp_path, "late-thread", [1]), "r0")
    try:
        generation = actor._generation
        actor._in_flight = asyncio.new_event_loop().create_future()  # a round in flight, then abandoned
        actor._abandon_in_flight()
        theta = {name: t + 1.0 for name, t in actor.global_state().items()}
        before = actor.digest()
        with pytest.raises(RoundAbandoned):
            actor._set_state(5, theta, {}, generation=generation)
        unchanged = (actor.digest(), actor.outer.step_count)
        actor._set_state(5, theta, {})  # not a round's load (a join, a resume): goes through
    finally:
        actor.shutdown()
    assert unchanged == (before, 0)
    assert actor.digest() != before and actor.outer.step_count == 5


def test_a_hung_bucket_costs_its_calls_not_the_round_or_the_group(tmp_path, monkeypatch):
    """issue 22 item 4: the peer-file and state-record listings ran inside every rendezvous poll, and the
    checkpoint save after a round, with no bound: a bucket that hangs held the round, then failed the group.
    Each is bounded now: the round goes on from the DHT, and the checkpoint is skipped with an event."""
    from ray_diloco.sync import durable, membership, peers

    def hang(*args, **kwargs):
        time.sleep(3600)

    cfg = config(tmp_path, "hung-bucket", [1, 1], matchmaking_seconds=MM)
    a = SyncActorImpl(cfg, "r0")
    b = None
    try:
        b = SyncActorImpl(cfg, "r1", initial_peers=a.multiaddrs())
        monkeypatch.setattr(membership, "LISTING_SECONDS", 0.5)
        monkeypatch.setattr(peers, "read_peer_files", hang)
        monkeypatch.setattr(durable, "read_records", hang)
        a._peers_read = a._stored_read = b._peers_read = b._stored_read = 0.0  # read again at the next poll

        async def both():
            return await asyncio.gather(a.exchange(0, 0, 1, trained(a, 20), tokens=1000),
                                        b.exchange(0, 0, 1, trained(b, 21), tokens=1000))

        started = time.monotonic()
        (step_a, _, _), (step_b, _, _) = asyncio.run(both())
        seconds = time.monotonic() - started
        monkeypatch.setattr(a, "_download_seconds", lambda: 0.5)
        a.store.save = hang
        committed = asyncio.run(a.commit_checkpoint(1, "worker-checkpoint"))
    finally:
        for actor in (b, a):
            if actor is not None:
                actor.shutdown()
    assert step_a == step_b == 1 and a.last_round()["group_size"] == 2, a.history
    assert seconds < 30, seconds  # the listings were given up after 0.5 s, not waited for
    assert committed is None and a.committed is None
    assert [e["outer_step"] for e in a.events if e["event"] == "checkpoint_failed"] == [1]


def test_a_nonfinite_delta_after_the_region_ended_publishes_nothing(tmp_path):
    """issue 22 item 4: a region that re-synced to the end during an overlapped round published FINISHED; a
    non-finite Δ in the blocking last call then published OUT and looked for a newer state after the end."""
    from ray_diloco.sync.policy import FINISHED, StateRecord

    cfg = config(tmp_path, "nonfinite-after-end", [1, 1], outer_steps=1, matchmaking_seconds=1.0)
    cfg["outer"].update(max_wait_seconds=1.0, averaging_timeout=2.0)
    actor = SyncActorImpl(cfg, "r0")
    published = []
    try:
        actor.outer.step_count = 1
        actor._published = StateRecord("r0", 1, actor.digest(), 2, FINISHED)
        actor._set_phase_safely = lambda phase, waited=0.0: published.append(phase)
        actor._resync_from_newer = lambda step: published.append("resync") or False
        before = actor.digest()
        shards = trained(actor, 5)
        next(iter(shards.values())).view(-1)[0] = float("nan")
        reached, _, _ = asyncio.run(actor.exchange(1, 0, 1, shards, tokens=1000))
    finally:
        actor.shutdown()
    assert published == [] and actor.digest() == before and reached == 1
    assert len(nonfinite_events(actor)) == 1


def test_a_region_joining_a_run_with_a_secret_gets_the_state_on_its_first_try(tmp_path):
    """With a secret, regions serve their state to members only (a signed record must name the peer). A region that
    joins mid-run asks for the state before its first state record: its signed joining record names it first, so
    the download is served at once (it was refused, and the join waited for a later `catch_up`)."""
    cfg = config(tmp_path, "secret-join", [1, 1], matchmaking_seconds=MM)
    secret = b"k" * 32
    ahead = SyncActorImpl(cfg, "r0", secret=secret)
    joining = None
    try:
        theta = trained(ahead, seed=6)
        ahead._set_state(4, theta, {})  # the run is at outer step 4
        ahead.catch_up()  # publishes it
        joining = SyncActorImpl(cfg, "r1", initial_peers=ahead.multiaddrs(), secret=secret)
        step, digest = joining.outer_step(), joining.digest()
    finally:
        for actor in (joining, ahead):
            if actor is not None:
                actor.shutdown()
    assert (step, digest) == (4, state_digest(theta))
    events = [e["event"] for e in joining.events]
    assert "region_joined" in events and "region_joined_failed" not in events
    assert not [e for e in ahead.events if e["event"] == "peer_rejected"]


def test_refused_peers_are_reported_once_each_up_to_a_bound_and_all_counted(tmp_path):
    """Peer IDs cost an intruder nothing: events name the first REPORTED_PEERS refused (peer, what) pairs, once
    each; every refusal is counted."""
    from ray_diloco.sync.actor import REPORTED_PEERS

    actor = SyncActorImpl(config(tmp_path, "refusals", [1]), "r0")
    for i in range(REPORTED_PEERS + 20):
        actor.peer_rejected(f"peer-{i}", "a state download")
    actor.peer_rejected("peer-0", "a state download")  # reported already
    reported = [e["peer"] for e in actor.events if e["event"] == "peer_rejected"]
    assert reported == [f"peer-{i}" for i in range(REPORTED_PEERS)]
    assert actor.stats()["peers_rejected"] == REPORTED_PEERS + 21


def test_routine_events_log_at_info_and_the_rest_at_warning(caplog):
    """A healthy run's start-up, resizes and a restart that continued AdamW are not warnings; a refused peer, a
    failed checkpoint or AdamW started anew is."""
    import logging
    from types import SimpleNamespace

    from ray_diloco.sync.actor import SyncActorImpl

    region = SimpleNamespace(events=[], region="region-a", outer=SimpleNamespace(step_count=3),
                             config=SimpleNamespace(run=SimpleNamespace(name="levels")))
    with caplog.at_level(logging.INFO, logger="ray_diloco.sync.actor"):
        for kind in ("hivemind_started", "peer_connected", "group_resized", "inner_state_restored", "peer_rejected",
                     "checkpoint_failed", "inner_state_reset"):
            SyncActorImpl.record_event(region, kind)
    levels = {record.getMessage().split("'event': '")[1].split("'")[0]: record.levelno for record in caplog.records}
    info, warning = logging.INFO, logging.WARNING
    assert levels == {"hivemind_started": info, "peer_connected": info, "group_resized": info,
                      "inner_state_restored": info, "peer_rejected": warning, "checkpoint_failed": warning,
                      "inner_state_reset": warning}
    assert [e["event"] for e in region.events] == list(levels)


class CalledInPlace:
    """What a Ray actor handle offers (`handle.method.remote(...)`), calling a plain instance of the actor's class in
    place: the SyncActor hands θ to the evaluator actor so."""

    def __init__(self, instance):
        self.instance = instance

    def __getattr__(self, name: str):
        return SimpleNamespace(remote=getattr(self.instance, name))


def test_the_evaluation_curve_counts_the_tokens_the_workers_trained(tmp_path):
    """A window that a preemption notice ended early hands in fewer tokens than H steps': the curve's tokens per worker
    count it short (they counted a whole window per outer step). A region resumed from its checkpoint keeps what it
    was short; steps taken over from another region's state count as whole windows (that state trained them, not
    zero tokens); the end's point of the curve counts as the region did."""
    cfg = config(tmp_path, "worker-tokens", [1], outer_steps=6, eval_every=1)
    window = ExperimentConfig.from_dict(cfg).tokens_per_worker(1)  # one worker's whole window
    short = window - window // 4  # 1 of H = 4 steps trained
    evaluator = EvaluatorImpl(cfg, torch.randint(0, 256, (2, 16)))
    actor = SyncActorImpl(cfg, "r0", evaluator=CalledInPlace(evaluator))
    try:
        asyncio.run(actor.exchange(0, 0, 1, trained(actor, 1), tokens=window))
        asyncio.run(actor.exchange(1, 0, 1, trained(actor, 2), tokens=window // 4))
        assert asyncio.run(actor.commit_checkpoint(2, str(tmp_path / "workers-2"))) is not None
    finally:
        actor.shutdown()
    resumed = SyncActorImpl(cfg, "r0", evaluator=CalledInPlace(evaluator), resume_step=2)
    try:
        asyncio.run(resumed.exchange(2, 0, 1, trained(resumed, 3), tokens=window))
        # Another region's state of step 4, taken over (a re-sync), then a window of our own.
        resumed._set_state(4, resumed.global_state(), resumed.outer.momentum_state())
        asyncio.run(resumed.exchange(4, 0, 1, trained(resumed, 4), tokens=window))
    finally:
        resumed.shutdown()
    assert [(p["outer_step"], p["tokens_per_worker"]) for p in evaluator.get_curve()] == [
        (1, window), (2, 2 * window - short), (3, 3 * window - short), (5, 5 * window - short)]
    assert resumed.stats()["tokens_per_worker"] == 5 * window - short
    # The end's evaluation, where the evaluator made no point of that step (eval_every > 1), counts them too.
    ended = TrainingOutcome(stats=[resumed.stats()], worker_results=[{"outer_step": 6}], finished=[0], final_state={},
                            curve=evaluator.get_curve(), data_counts={})
    end = eval_curve(ExperimentConfig.from_dict(cfg), ended, 9.0, 5.0, 148.4)[-1]
    assert (end["outer_step"], end["tokens_per_worker"]) == (6, 6 * window - short)
