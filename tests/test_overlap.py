"""The overlapped outer step (`outer.overlap`) against a hand-written reference of the one-step-delay update.

One region, the SyncActor as a plain class (no Hivemind: its own Δ goes through the wire codec alone), a fake
worker whose "H inner steps" subtract a fixed random update from the state it was handed. The reference below is
written from the scheme in ray_diloco.sync.actor's docstring, not from the actor's code:
* exchange k: Δ_k = base_k − θ_local,k; wait for round k−1 (θ_global,k); overlapped, hand back
  base_{k+1} = θ_global,k + (θ_local,k − base_k) and run round k in the background;
* blocking (the last round, a checkpoint's round): run round k now and hand back θ_global,k+1 itself;
* a round: θ ← θ − lr·(g + m·buf), buf ← m·buf + g (buf = g the first time), g = fp16-codec(Δ).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from conftest import small_run
from ray_diloco.sync.actor import SyncActorImpl
from ray_diloco.sharding import from_wire, rows_for_rank
from ray_diloco.sync.codecs import get_codec

LR, MOMENTUM = 0.7, 0.9


def config(tmp_path, outer_steps: int, checkpoint_every: int = 0) -> dict:
    cfg = small_run(tmp_path, "overlap", workers=[1], outer_steps=outer_steps, data={})  # rounds of 1000 tokens
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, vocab_size=256),
        outer=dataclasses.replace(cfg.outer, overlap=True, lr=LR, momentum=MOMENTUM, nesterov=True),
        run=dataclasses.replace(cfg.run, checkpoint_every=checkpoint_every)).to_dict()


def inner_update(step: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {name: 1e-3 * torch.randn(t.shape, generator=g) for name, t in like.items()}


def reference(initial: dict[str, torch.Tensor], outer_steps: int, compression: str, blocking: set[int]):
    """What the workers are handed after each exchange, and θ_global at the end."""
    codec = get_codec(compression)
    theta = {k: v.clone() for k, v in initial.items()}
    buf: dict[str, torch.Tensor] = {}
    base = {k: v.clone() for k, v in initial.items()}  # the workers start from θ_global,0
    pending = None  # Δ of the round in flight

    def outer_round(delta):
        for k in theta:
            g = codec.roundtrip(delta[k])
            buf[k] = g.clone() if k not in buf else buf[k] * MOMENTUM + g
            theta[k] = theta[k] - (g + buf[k] * MOMENTUM) * LR

    handed = []
    for step in range(outer_steps):
        local = {k: base[k] - u for k, u in inner_update(step, base).items()}
        delta = {k: base[k] - local[k] for k in base}
        if pending is not None:
            outer_round(pending)
            pending = None
        if step in blocking:
            outer_round(delta)
            base = {k: v.clone() for k, v in theta.items()}
        else:
            base = {k: theta[k] + (local[k] - base[k]) for k in theta}
            pending = delta
        handed.append(base)
    return handed, theta


def drive(actor: SyncActorImpl, outer_steps: int, notices: frozenset = frozenset()) -> list[tuple[int, dict]]:
    """A one-worker region: train (the fixed update) from what it was handed, exchange, repeat; under a preemption
    notice at the exchanges of `notices` (the workers checkpoint those rounds)."""
    async def loop():
        state, out = actor.global_state(), []
        for step in range(outer_steps):
            local = {k: state[k] - u for k, u in inner_update(step, state).items()}
            reached, rows, _ = await actor.exchange(step, 0, 1, local, tokens=1000, notice=step in notices)
            state = from_wire(rows)
            out.append((reached, state))
        return out
    return asyncio.run(loop())


@pytest.mark.parametrize("outer_steps,every,notices,blocking", [
    (4, 0, frozenset(), {3}),
    (5, 2, frozenset(), {1, 3, 4}),
    (5, 0, frozenset({1, 2}), {1, 2, 4}),  # rounds under a preemption notice are checkpointed: they block
])
def test_the_delayed_update_equals_the_hand_written_reference(tmp_path, outer_steps, every, notices, blocking):
    actor = SyncActorImpl(config(tmp_path, outer_steps, every), "r0")
    initial = actor.global_state()
    handed, final = reference(initial, outer_steps, actor.config.outer.compression, blocking)
    got = drive(actor, outer_steps, notices)
    assert [reached for reached, _ in got] == list(range(1, outer_steps + 1))
    for step, ((_, state), expected) in enumerate(zip(got, handed)):
        for name in expected:  # bit for bit: the same separately rounded operations
            assert torch.equal(state[name], expected[name]), (step, name)
    assert actor.outer_step() == outer_steps
    assert all(torch.equal(actor.global_state()[k], final[k]) for k in final)
    assert [r["overlapped"] for r in actor.history] == [s not in blocking for s in range(outer_steps)]
    # Not the blocking update: the workers' drift was kept (the reference with every round blocking differs).
    blocking_handed, _ = reference(initial, outer_steps, actor.config.outer.compression, set(range(outer_steps)))
    assert not torch.equal(next(iter(handed[0].values())), next(iter(blocking_handed[0].values())))


def test_a_stale_exchange_is_refused_and_a_restart_starts_from_theta_global(tmp_path):
    actor = SyncActorImpl(config(tmp_path, outer_steps=4), "r0")
    state = actor.global_state()
    local = {k: state[k] - u for k, u in inner_update(0, state).items()}

    async def scenario():
        reached, handed, _ = await actor.exchange(0, 0, 1, local, tokens=1000)
        with pytest.raises(RuntimeError, match="workers should be at step 1"):
            await actor.exchange(0, 0, 1, local, tokens=1000)  # the same round again: another base
        restarted = await actor.resume_state(0, 1)  # a new group: the round in flight ends first
        return reached, from_wire(handed), restarted

    reached, handed, restarted = asyncio.run(scenario())
    assert reached == 1 and restarted["outer_step"] == 1 == actor.outer_step()
    # The overlapped hand-back carried the drift; the restart gets θ_global,1 itself, and exchanges from it.
    assert all(torch.equal(from_wire(restarted["rows"])[k], actor.global_state()[k]) for k in state)
    assert not all(torch.equal(handed[k], actor.global_state()[k]) for k in state)
    assert actor.base is None


def test_the_status_line_after_an_overlapped_exchange_names_the_newest_completed_round():
    """The first overlapped exchange has no completed round yet (a KeyError there restarted every group once)."""
    from ray_diloco.worker import sync_status

    assert "no round completed yet" in sync_status("r0", 1, 4, 0.01, {})
    line = sync_status("r0", 2, 4, 0.01, {"outer_step": 0, "group_size": 2, "peers": ["r0", "r1"]})
    assert "handed in" in line and "step 1 synced with 2 region(s)" in line
    assert "synced in 0.01s with 2 region(s): r0, r1" in sync_status(
        "r0", 1, 4, 0.01, {"outer_step": 0, "group_size": 2, "peers": ["r0", "r1"]})
    # an abandoned round (not advanced): the workers stay at outer step 1 and train towards step 2 again
    assert sync_status("r0", 1, 4, 312.4, {}, advanced=False) == (
        "[r0] outer step 2/4: the round was abandoned after 312s; training towards it again on the next batches")


def test_every_rank_of_a_restarting_group_gets_the_state_after_the_round_in_flight(tmp_path):
    """Two ranks hand in (overlapped), the round is still running (slowed here), and the group restarts: both
    ranks' resume_state calls, at once, wait for that same round and get the same outer step and θ_global."""
    actor = SyncActorImpl(config(tmp_path, outer_steps=4), "r0")
    state = actor.global_state()
    run_round = actor._run_round

    async def slow_round(*args):  # the all-reduce of a real link takes a while
        await asyncio.sleep(0.5)
        return await run_round(*args)
    actor._run_round = slow_round
    halves = [{k: v[:v.shape[0] // 2] for k, v in state.items()}, {k: v[v.shape[0] // 2:] for k, v in state.items()}]
    for rank in (0, 1):
        actor.register_worker(rank, 2, 100 + rank, "host")

    async def scenario():
        await asyncio.gather(*(actor.exchange(0, rank, 2, {k: t - 1e-3 for k, t in halves[rank].items()}, 1000)
                               for rank in (0, 1)))
        assert actor.outer_step() == 0  # handed back at once; the round runs
        return await asyncio.gather(actor.resume_state(0, 2), actor.resume_state(1, 2))

    first, second = asyncio.run(scenario())
    assert first["outer_step"] == second["outer_step"] == 1 == actor.outer_step()
    for rank, point in enumerate((first, second)):
        expected = rows_for_rank(actor.global_state(), 2, rank)
        assert all(torch.equal(from_wire(point["rows"])[name], expected[name]) for name in expected)
