"""The compressed outer methods over real Hivemind: three regions' SyncActors (ray_diloco.sync.actor, as plain
classes in this process, each with its own DHT node, averager and payload exchange on 127.0.0.1).

For sparseloco and for dct, three rounds with one worker per region and unequal tokens:
* every round's group is all three regions and θ_global is bit-identical on every region after every round;
* θ_global equals the outer step recomputed here from what each region sent: fresh Compressors fed the same Δs,
  their payloads aggregated in region order with token weights, θ ← θ − lr·mean (plain SGD);
* each region's payload went to the two others (bytes sent ≥ 2 payloads) and is far smaller than dense fp16;
* killed and restarted equals uninterrupted: three new actors resumed from the checkpoints of outer step 2
  (θ_global, and each region's error feedback / momentum) repeat round 3 and reach the same bits;
* overlapped rounds (outer.overlap, sparseloco): every round runs while the workers train on, and θ_global is
  still bit-identical on every region and equals the recomputed steps;
* a round abandoned after its payload was made leaves the error feedback as it was; the next round stores exactly
  what a fresh compressor keeps after that round's Δ;
* a region joining mid-run (sparseloco and dct): r0 and r1 average two rounds, r2 then starts and takes their
  state; the third round is one group of three, bit-identical, and equals the step recomputed with
  r2's compressor fresh from it;
* an absent region and a re-sync (sparseloco): r2's Δ is NaN in round 2, so it sits out; r0 and r1 average as two
  (group 2, both consistent) and r2 takes their state with its error feedback reset to zero (the stated rule:
  what it owed was on the θ it left); in round 3 all three are one group again and agree bit for bit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

from conftest import small_run
from ray_diloco.config import ExperimentConfig
from ray_diloco.methods.compressors import Compressor
from ray_diloco.methods.settings import MethodSettings
from ray_diloco.sharding import from_wire
from ray_diloco.sync.actor import SyncActorImpl
from ray_diloco.sync.outer import state_digest

REGIONS = ("r0", "r1", "r2")
TOKENS = {"r0": 1000, "r1": 3000, "r2": 2000}
ROUNDS = 3


def config(tmp_path, method: str) -> dict:
    cfg = small_run(tmp_path, f"compressed-{method}", workers=[1, 1, 1], matchmaking_seconds=3.0, outer_steps=10,
                    data={})  # its rounds declare TOKENS, within what the preset's windows hold
    outer = dataclasses.replace(cfg.outer, method=method, momentum=0.0, nesterov=False, lr=1.0,
                                topk=8 if method == "sparseloco" else 0)
    return dataclasses.replace(cfg, outer=outer, model=dataclasses.replace(cfg.model, vocab_size=256)).to_dict()


def local(theta: dict[str, torch.Tensor], region: str, step: int) -> dict[str, torch.Tensor]:
    """The region's parameters after its inner steps of round `step`: θ_global moved by a fixed random amount."""
    g = torch.Generator().manual_seed(1000 * step + REGIONS.index(region))
    return {name: t + 1e-3 * torch.randn(t.shape, generator=g) for name, t in theta.items()}


def start(cfg: dict, resume_step: int | None = None) -> dict[str, SyncActorImpl]:
    actors: dict[str, SyncActorImpl] = {}
    try:
        for region in REGIONS:
            peers = actors["r0"].multiaddrs() if actors else None
            actors[region] = SyncActorImpl(cfg, region, initial_peers=peers, record_rounds=True,
                                           resume_step=resume_step)
    except BaseException:
        stop(actors)
        raise
    return actors


def stop(actors: dict[str, SyncActorImpl]) -> None:
    for actor in actors.values():
        actor.shutdown()


def one_round(actors: dict[str, SyncActorImpl], step: int) -> None:
    async def every_region():
        return await asyncio.gather(*(
            actor.exchange(step, 0, 1, local(actor.global_state(), region, step), tokens=TOKENS[region])
            for region, actor in actors.items()))
    asyncio.run(every_region())


def recomputed(cfg: dict, theta: dict[str, torch.Tensor], recorded: dict[str, list[dict]],
               joined: dict[str, int] | None = None) -> list[str]:
    """θ_global's digest after each round, from what the regions sent, in plain PyTorch and Compressors.
    `joined`: the round a region first took part in (default 0), its compressor fresh there."""
    outer = ExperimentConfig.from_dict(cfg).outer
    shapes = {name: t.shape for name, t in theta.items()}
    compressors = {region: Compressor(MethodSettings.of(outer), shapes) for region in REGIONS}
    first = {region: (joined or {}).get(region, 0) for region in REGIONS}
    digests = []
    for step in range(len(recorded["r0"])):
        sent = [(r, recorded[r][step - first[r]]) for r in REGIONS if first[r] <= step]
        payloads = [(round_["tokens"], compressors[r].compress(round_["delta"])[0]) for r, round_ in sent]
        mean = compressors["r0"].aggregate(payloads)
        theta = {name: torch.sub(t, torch.mul(mean[name], cfg["outer"]["lr"])) for name, t in theta.items()}
        digests.append(state_digest(theta))
    return digests


@pytest.mark.parametrize("method", ["sparseloco", "dct"])
def test_three_regions_agree_bit_for_bit_and_a_restart_repeats_the_uninterrupted_round(tmp_path, method):
    cfg = config(tmp_path, method)
    actors = start(cfg)
    try:
        initial = actors["r0"].global_state()
        digests = []
        for step in range(ROUNDS):
            one_round(actors, step)
            digests.append({region: actor.digest() for region, actor in actors.items()})
            if step == 1:  # every region checkpoints outer step 2 (θ_global and its compressor state)
                for actor in actors.values():
                    asyncio.run(actor.commit_checkpoint(2, "worker-checkpoint"))
        rounds = {region: actor.history for region, actor in actors.items()}
        recorded = {region: actor.recorded for region, actor in actors.items()}
        payload_bytes = actors["r0"].compressor.payload_bytes()
    finally:
        stop(actors)

    for step, by_region in enumerate(digests):
        assert len(set(by_region.values())) == 1, f"round {step}: regions differ: {by_region}"
        assert all(rounds[r][step]["group_size"] == 3 and rounds[r][step]["consistent"] for r in REGIONS)
    assert [d["r0"] for d in digests] == recomputed(cfg, initial, recorded)
    dense_fp16 = 2 * sum(t.numel() for t in initial.values())
    assert payload_bytes * 8 < dense_fp16  # at least 8× fewer bytes than fp16 DiLoCo (the defaults give 36×)
    for region in REGIONS:
        assert all(r["payload_bytes"] == payload_bytes for r in rounds[region])
        assert all(r["bytes_sent"] >= 2 * payload_bytes for r in rounds[region])  # both others fetched it
        assert all(r["bytes_received"] >= 2 * payload_bytes for r in rounds[region])

    resumed = start(cfg, resume_step=2)
    try:
        assert all(actor.outer_step() == 2 and actor.compressor.state for actor in resumed.values())
        one_round(resumed, 2)
        after_restart = {region: actor.digest() for region, actor in resumed.items()}
        events = [e["event"] for actor in resumed.values() for e in actor.events]
    finally:
        stop(resumed)
    assert after_restart == digests[2]  # killed and restarted equals uninterrupted, bit for bit
    assert "resync" not in events and "region_joined" not in events  # nobody took another's state instead


def test_a_region_that_sits_out_resyncs_with_its_error_feedback_reset_and_rejoins(tmp_path):
    cfg = config(tmp_path, "sparseloco")
    actors = start(cfg)
    try:
        one_round(actors, 0)

        async def r2_diverges():
            shards = {region: local(actor.global_state(), region, 1) for region, actor in actors.items()}
            next(iter(shards["r2"].values())).view(-1)[0] = float("nan")
            return await asyncio.gather(*(actors[r].exchange(1, 0, 1, shards[r], tokens=TOKENS[r]) for r in REGIONS))

        asyncio.run(r2_diverges())
        second = {region: actor.last_round() for region, actor in actors.items()}
        r2_state_after_resync = dict(actors["r2"].compressor.state)
        one_round(actors, 2)
        third = {region: (actor.last_round(), actor.digest()) for region, actor in actors.items()}
        events = [e["event"] for e in actors["r2"].events]
    finally:
        stop(actors)
    assert [second[r]["group_size"] for r in REGIONS] == [2, 2, 0] and second["r0"]["consistent"]
    assert second["r0"]["digest"] == second["r1"]["digest"]
    assert "nonfinite_pseudo_gradient" in events and "resync" in events
    assert r2_state_after_resync == {}  # re-synced: starts its error feedback at zero
    assert all(third[r][0]["group_size"] == 3 and third[r][0]["consistent"] for r in REGIONS)
    assert len({digest for _, digest in third.values()}) == 1


@pytest.mark.parametrize("method", ["sparseloco", "dct"])
def test_a_region_joining_mid_run_takes_the_state_and_its_first_round_is_the_recomputed_step(tmp_path, method):
    """r0 and r1 average two rounds; r2 then starts (as a region whose cluster came up late) and takes their state
    as it starts (`catch_up` then has nothing left to do), its compressor state empty (a joining region owes
    nothing on a θ it never trained from); the third round is one group of three, bit-identical, equal to the
    step recomputed with r2's compressor fresh from that round on."""
    cfg = config(tmp_path, method)
    actors: dict[str, SyncActorImpl] = {}
    try:
        actors["r0"] = SyncActorImpl(cfg, "r0", record_rounds=True)
        actors["r1"] = SyncActorImpl(cfg, "r1", initial_peers=actors["r0"].multiaddrs(), record_rounds=True)
        initial = actors["r0"].global_state()
        for step in range(2):
            one_round(actors, step)
        actors["r2"] = SyncActorImpl(cfg, "r2", initial_peers=actors["r0"].multiaddrs(), record_rounds=True)
        assert actors["r2"].catch_up() == 2
        assert actors["r2"].digest() == actors["r0"].digest()
        one_round(actors, 2)
        rounds = {region: actor.history for region, actor in actors.items()}
        recorded = {region: actor.recorded for region, actor in actors.items()}
        joins = [e for e in actors["r2"].events if e["event"] == "region_joined"]
    finally:
        stop(actors)
    assert [r["group_size"] for r in rounds["r0"]] == [2, 2, 3] and len(rounds["r2"]) == 1, rounds
    assert all(r["consistent"] for region in REGIONS for r in rounds[region])
    assert len({rounds[region][-1]["digest"] for region in REGIONS}) == 1
    assert [r["digest"] for r in rounds["r0"]] == recomputed(cfg, initial, recorded, joined={"r2": 2})
    assert [e["to_step"] for e in joins] == [2], joins


def test_overlapped_compressed_rounds_agree_and_equal_the_recomputed_steps(tmp_path):
    cfg = config(tmp_path, "sparseloco")
    cfg["outer"]["overlap"] = True
    cfg["run"]["checkpoint_every"] = 0  # a checkpointed round blocks
    actors = start(cfg)
    try:
        initial = actors["r0"].global_state()

        async def overlapped_rounds():
            handed = {region: (0, actor.global_state()) for region, actor in actors.items()}
            for step in range(ROUNDS):  # the workers train from what they were handed, told which step is next
                results = await asyncio.gather(*(
                    actors[r].exchange(handed[r][0], 0, 1, local(handed[r][1], r, step), tokens=TOKENS[r])
                    for r in REGIONS))
                handed = {r: (reached, from_wire(rows)) for r, (reached, rows, _) in zip(REGIONS, results)}
            await asyncio.gather(*(actor._finish_in_flight() for actor in actors.values()))  # the last in flight

        asyncio.run(overlapped_rounds())
        rounds = {region: actor.history for region, actor in actors.items()}
        recorded = {region: actor.recorded for region, actor in actors.items()}
    finally:
        stop(actors)
    for region in REGIONS:
        assert [(r["overlapped"], r["group_size"], r["consistent"]) for r in rounds[region]] == [(True, 3, True)] * 3
    digests = [rounds["r0"][step]["digest"] for step in range(ROUNDS)]
    assert all([r["digest"] for r in rounds[region]] == digests for region in REGIONS)
    assert digests == recomputed(cfg, initial, recorded)


def test_an_abandoned_compressed_round_leaves_the_error_feedback_as_it_was(tmp_path):
    """A compressed method's round abandoned after its payload was made (its executor thread runs on): the next
    round's Δ holds this window again, so the error feedback must not have absorbed it (it did: compress moved it
    at once, and the next round counted the window twice). It moves with the outer step: the round that applies
    stores exactly what a fresh compressor keeps after that round's Δ."""
    cfg = config(tmp_path, "sparseloco")
    cfg["regions"] = cfg["regions"][:1]
    actor = SyncActorImpl(cfg, "r0")  # one region: no Hivemind needed
    made, release = threading.Event(), threading.Event()
    real = actor._average_compressed

    def stuck_after_the_payload(*args):
        result = real(*args)
        made.set()
        release.wait(30)  # the exchange, stuck past the round's bound
        return result

    try:
        actor._average_compressed = stuck_after_the_payload

        async def a_round_abandoned():
            round_ = asyncio.ensure_future(actor.exchange(0, 0, 1, local(actor.global_state(), "r0", 0),
                                                          tokens=1000))
            while not made.is_set():
                await asyncio.sleep(0.01)
            round_.cancel()  # as _abandon_in_flight cancels it
            await asyncio.sleep(0)
            release.set()
            return round_

        assert asyncio.run(a_round_abandoned()).cancelled()
        abandoned = (dict(actor.compressor.state), actor.outer.step_count)
        actor._average_compressed = real
        before = actor.global_state()
        trained = local(before, "r0", 1)
        asyncio.run(actor.exchange(0, 0, 1, trained, tokens=1000))
        applied = (actor.compressor.state_dict(), actor.outer.step_count)
    finally:
        release.set()
        actor.shutdown()
    assert abandoned == ({}, 0)
    fresh = Compressor(MethodSettings.of(ExperimentConfig.from_dict(cfg).outer), actor.shapes)
    fresh.compress({name: before[name] - trained[name] for name in before})
    assert applied[1] == 1 and applied[0].keys() == fresh.state.keys()
    assert all(torch.equal(applied[0][name], fresh.state[name]) for name in fresh.state)
