"""Sharing the outer state between regions (ray_diloco.sync.state_sharing), on 127.0.0.1 with real DHTs and p2pd.

Three DHTs (the 2nd and 3rd join the 1st) are shared by the module; each test uses its own run id, and a loader
never sits on the same DHT as the holder it loads from (libp2p does not dial itself). Checks that:
* B loads A's (outer_step, θ, momentum) bit-identically (fp32/fp64, a scalar, a transposed tensor, tensors
  split into many chunks, no momentum at step 0); A changing its tensors in place without publishing does not
  change what is served (the published snapshot); after A republishes, B gets the new state, not the old;
  a new phase (ready to average) reaches B's records while the served state stays the published one;
* with X held by two regions at step 3 and Y by one, the odd one's needs_resync is X's record and
  load_from_peers(want=X) yields θ with digest X, also when the wanted holder lies (serves Y under an X record:
  the next holder of X is used) and from a holder in lazy mode (snapshot=False);
* a sharer of another run on the same DHT is not in records(); state keys and the averager's round prefixes
  sanitise a run id with the same function (one sanitiser, two uses);
* load_from_peers returns None within its timeout when nobody holds the state, when the holder's handler is
  gone, when the holder's peer does not exist, and when the holder died without withdrawing its record.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from hivemind import DHT
from hivemind.utils import get_dht_time

from ray_diloco.sync.averaging import round_prefix, safe_name
from ray_diloco.sync.outer import state_digest
from ray_diloco.sync.policy import READY, needs_resync
from ray_diloco.sync.state_sharing import StateRecord, StateSharer, check_header, state_key

R = StateRecord


def test_state_keys_and_round_prefixes_sanitise_run_ids_alike():
    for run_id in ("run.A", "run_A", "ä/b c" * 20):
        safe = safe_name(run_id)
        assert "." not in safe and "/" not in safe and " " not in safe
        assert state_key(run_id) == f"diloco_{safe}_state" and round_prefix(run_id, 3) == f"diloco_{safe}_r3"
    assert safe_name("run.A") != safe_name("run_A")  # equal after sanitising, told apart by the hash tag


SCHEMA = {"emb": ((300, 70), "float32"), "w": ((5, 3), "float32")}


def header(*tensors):
    return {"outer_step": 3, "digest": "d", "tensors": [list(t) for t in tensors]}


def test_a_state_header_is_checked_against_the_models_own_parameters_before_any_allocation():
    good = [("theta", "emb", "float32", [300, 70]), ("theta", "w", "float32", [5, 3])]
    assert [(k, n, tuple(s)) for k, n, s, _ in check_header(header(*good), SCHEMA)] == [
        ("theta", "emb", (300, 70)), ("theta", "w", (5, 3))]
    momentum = [("momentum", "emb", "float32", [300, 70]), ("momentum", "w", "float32", [5, 3])]
    assert len(check_header(header(*good, *momentum), SCHEMA)) == 4
    crafted = {
        "huge shape": [("theta", "emb", "float32", [2**40, 2**20]), good[1]],  # never allocated
        "wrong shape": [("theta", "emb", "float32", [70, 300]), good[1]],
        "momentum of the wrong shape": [*good, ("momentum", "w", "float32", [3, 5])],
        "another dtype": [("theta", "emb", "float64", [300, 70]), good[1]],
        "an unknown tensor": [*good, ("theta", "evil", "float32", [1])],
        "a tensor twice": [*good, good[0]],
        "a missing parameter": [good[0]],
        "another kind": [*good, ("gradient", "w", "float32", [5, 3])],
        "a malformed entry": [*good, ("theta", "w")],
        "a shape that is no list": [("theta", "emb", "float32", "300x70"), good[1]],
    }
    for what, tensors in crafted.items():
        with pytest.raises(ValueError):
            check_header(header(*tensors), SCHEMA)
            pytest.fail(f"{what} was accepted")
    with pytest.raises(ValueError, match="lists no tensors"):
        check_header({"outer_step": 3}, SCHEMA)


def test_momentum_of_the_wrong_shape_is_refused():
    from ray_diloco.sync.outer import OuterOptimizer

    outer = OuterOptimizer({"w": torch.zeros(5, 3)}, lr=0.7, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="wrong shape"):
        outer.load_momentum({"w": torch.zeros(3, 5)})
    with pytest.raises(ValueError, match="wrong shape"):
        outer.load_momentum({"w": torch.zeros(1)})  # would broadcast into θ at the next step
    outer.load_momentum({"w": torch.ones(5, 3)})


# -- with DHTs --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dhts():
    first = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers = first.get_visible_maddrs()
    nodes = [first] + [DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers)
                       for _ in range(2)]
    yield nodes
    for node in nodes:
        node.shutdown()


class Region:
    """A region's outer state, updated in place (as the SyncActor's OuterOptimizer does)."""

    def __init__(self, seed: int, step: int = 0, momentum: bool = True):
        g = torch.Generator().manual_seed(seed)
        self.step = step
        self.theta = {"emb": torch.randn(300, 70, generator=g), "w": torch.randn(5, 3, 2, generator=g),
                      "s": torch.randn((), generator=g), "d": torch.randn(33, generator=g, dtype=torch.float64),
                      "t": torch.randn(7, 5, generator=g).t()}  # not contiguous
        self.momentum = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in self.theta.items()
                         if k != "s"} if momentum else {}

    def get_state(self):
        return self.step, self.theta, self.momentum

    def record(self, region: str, group_size: int) -> StateRecord:
        return StateRecord(region, self.step, state_digest(self.theta), group_size,
                           momentum_digest=state_digest(self.momentum))


REGION_SCHEMA = {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in Region(0).theta.items()}


def assert_same_state(got, region: Region):
    step, theta, momentum = got
    assert step == region.step
    assert theta.keys() == region.theta.keys() and momentum.keys() == region.momentum.keys()
    for mine, theirs in ((theta, region.theta), (momentum, region.momentum)):
        for name, tensor in theirs.items():
            assert mine[name].dtype == tensor.dtype and mine[name].shape == tensor.shape, name
            assert torch.equal(mine[name], tensor), name


@pytest.fixture
def sharers():
    made = []

    def make(*args, **kwargs):  # every Region has the same parameters: one schema for all
        made.append(StateSharer(*args, schema=REGION_SCHEMA, **kwargs))
        return made[-1]

    yield make
    for sharer in made:
        sharer.shutdown()


def test_load_bit_identical_then_follow_updates(dhts, sharers):
    a_state = Region(seed=1, step=0, momentum=False)
    a = sharers(dhts[0], "load", "a", a_state.get_state, chunk_bytes=4096)  # 'emb' comes in 21 chunks
    b = sharers(dhts[1], "load", "b", lambda: (0, {}, {}))
    assert b.load_from_peers(timeout=10) is None  # nothing published yet

    a.publish(a_state.record("a", 0))  # the initial state: no momentum yet
    assert b.records() == [a_state.record("a", 0)]
    assert_same_state(b.load_from_peers(timeout=30), a_state)

    a_state.momentum = {k: torch.full(v.shape, 0.5).to(v.dtype) for k, v in a_state.theta.items()}
    for step in (1, 2):
        for name, tensor in a_state.theta.items():  # in place, like the outer optimizer
            tensor.add_(torch.randn(tensor.shape).to(tensor.dtype))
            a_state.momentum.get(name, tensor.new_zeros(())).mul_(-1.5)
        a_state.step = step
        a.publish(a_state.record("a", 2))
        published = {k: v.clone() for k, v in a_state.theta.items()}
        got = b.load_from_peers(timeout=30)
        assert_same_state(got, a_state)
        # changed in place but not published: peers still get the published, consistent snapshot
        a_state.theta["emb"].add_(1.0)
        a_state.step += 10
        again = b.load_from_peers(timeout=30)
        assert again[0] == step and all(torch.equal(again[1][k], v) for k, v in published.items())
        a_state.theta["emb"].copy_(published["emb"])
        a_state.step -= 10
    assert b.records() == [a_state.record("a", 2)]
    a.set_phase(READY)  # the record changes phase; the served state stays the published one
    assert b.records() == [dataclasses.replace(a_state.record("a", 2), phase=READY)]
    assert_same_state(b.load_from_peers(timeout=30), a_state)

    with pytest.raises(ValueError):  # a record that does not describe the state is refused
        a.publish(StateRecord("a", 2, "0" * 32, 2))


def test_a_holder_serving_another_momentum_than_its_record_names_is_passed_over(dhts, sharers):
    """issue 24: the digest covered θ_global only, so a holder could serve any momentum of the right shapes. The
    record names the momentum's digest too: a's stream (the right θ, another momentum) is refused, b's taken."""
    honest = Region(seed=5, step=2)
    lying = (2, honest.theta, {name: t + 1.0 for name, t in honest.momentum.items()})
    a = sharers(dhts[0], "momentum", "a", lambda: lying)
    b = sharers(dhts[1], "momentum", "b", honest.get_state)
    c = sharers(dhts[2], "momentum", "c", lambda: (0, {}, {}))
    a.publish(honest.record("a", 2), state=lying, verify=False)  # its record names the honest momentum
    b.publish(honest.record("b", 2))
    assert_same_state(c.load_from_peers(want=honest.record("a", 2), timeout=30), honest)


def test_odd_region_resyncs_to_majority(dhts, sharers):
    x, y = Region(seed=2, step=3), Region(seed=3, step=3)
    liar_state = Region(seed=3, step=3)  # serves Y ...
    a = sharers(dhts[0], "odd", "a", x.get_state)
    b = sharers(dhts[1], "odd", "b", x.get_state, snapshot=False)  # lazy: get_state() at each request
    c = sharers(dhts[2], "odd", "c", y.get_state)
    liar = sharers(dhts[0], "odd", "liar", liar_state.get_state, snapshot=False)
    for sharer, state, group in ((a, x, 2), (b, x, 2), (c, y, 1)):
        sharer.publish(state.record(sharer.region, group))
    liar.publish(StateRecord("liar", 3, state_digest(x.theta), 2))  # ... under an X record

    records = c.records()
    assert {r.region for r in records} == {"a", "b", "c", "liar"}
    want = needs_resync(y.record("c", 1), records)
    assert want == x.record("a", 2)
    assert needs_resync(x.record("a", 2), a.records()) is None
    assert needs_resync(x.record("b", 2), b.records()) is None

    for target in (want, x.record("b", 2), StateRecord("liar", 3, want.digest, 2), None):
        got = c.load_from_peers(want=target, timeout=30)
        assert got is not None, target
        assert state_digest(got[1]) == want.digest
        assert_same_state(got, x)
    # A holder of Y (c) is found for Y
    got = a.load_from_peers(want=y.record("c", 1), timeout=30)
    assert got is not None and state_digest(got[1]) == state_digest(y.theta)


def test_runs_are_isolated(dhts, sharers):
    mine, other = Region(seed=4, step=1), Region(seed=5, step=7)
    a = sharers(dhts[0], "iso-run", "a", mine.get_state)
    b = sharers(dhts[1], "iso-run", "b", lambda: (0, {}, {}))
    stranger = sharers(dhts[1], "iso.run", "a", other.get_state)  # same region name, same sanitised run id
    a.publish(mine.record("a", 1))
    stranger.publish(other.record("a", 3))
    assert a.records() == b.records() == [mine.record("a", 1)]
    assert stranger.records() == [other.record("a", 3)]
    assert state_key("iso-run") != state_key("iso.run")
    assert_same_state(b.load_from_peers(timeout=30), mine)  # the canonical state of *this* run
    a.shutdown()  # withdraws its record
    assert b.records() == []


def test_no_holder_returns_none(dhts, sharers):
    lonely = sharers(dhts[0], "nobody", "a", lambda: (0, {}, {}))
    start = time.monotonic()
    assert lonely.load_from_peers(timeout=5) is None
    assert lonely.load_from_peers(want=StateRecord("b", 2, "f" * 32, 2), timeout=5) is None
    assert time.monotonic() - start < 10
    # Records whose holders cannot serve: a live peer without the handler, a peer that does not exist.
    key = state_key("nobody")
    ghosts = {"b": str(dhts[1].peer_id), "c": "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"}
    for region, peer in ghosts.items():
        dhts[2].store(key, subkey=region, expiration_time=get_dht_time() + 60,
                      value=dict(outer_step=2, digest="f" * 32, group_size=2, peer_id=peer))
    assert {r.region for r in lonely.records()} == {"b", "c"}
    for timeout in (3.0, 20.0):
        start = time.monotonic()
        assert lonely.load_from_peers(timeout=timeout) is None
        assert time.monotonic() - start < timeout + 2

    # A holder that served once, then died (its DHT and p2pd gone) without withdrawing its record.
    doomed = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dhts[0].get_visible_maddrs())
    dead_state = Region(seed=6, step=2)
    dead = sharers(doomed, "nobody", "d", dead_state.get_state)
    dead.publish(dead_state.record("d", 2))
    assert_same_state(lonely.load_from_peers(want=dead_state.record("d", 2), timeout=30), dead_state)
    doomed.shutdown()
    assert dead_state.record("d", 2) in lonely.records()
    start = time.monotonic()
    assert lonely.load_from_peers(want=dead_state.record("d", 2), timeout=10) is None
    assert time.monotonic() - start < 12
    start = time.monotonic()
    dead.shutdown()  # its DHT is gone: no tombstone, and no hang
    assert time.monotonic() - start < 12
