"""Cross-region averaging over Hivemind (ray_diloco.sync.averaging), on 127.0.0.1 with real DHTs and p2pd.

Regions run in threads of the test process; each has its own DHT and forks one averager per round.
Checks that:
* with 2 and 3 regions (fp16, scaled-fp16, bf16 and none on the wire) every region gets bit-identical
  averages and equal digests, equal to Σ wᵢ·codec(Δᵢ)/Σ wᵢ through the codec (fp16 within one fp16
  rounding; values above 65504 are clamped by fp16, never inf, and kept by scaled-fp16; 'none' within 1e-6
  of the fp32 weighted average);
* scaled-fp16 over 3 real peers: Δ = 1e5, 1e5, 0 average to 66,666.67 (not fp16's clamped 43,669) on
  every peer bit for bit; each part message is 9 bytes larger than fp16's (4 of them the scale);
* fp16 sends half the bytes of 'none' for the same tensors (±2 %);
* two runs on one DHT (4 regions, 2 per run) average only within their run, and regions at different
  round indices never average together;
* a missing region (3 expected, 2 present) ends the round after matchmaking_seconds with the 2 present;
* a region alone gets its own Δ through the codec, group_size 1, within the timeout;
* a reducer that dies before its last reply fails the round at once;
* a reducer's round lasts until a slow sender holds every reply (else the sender loses the last parts);
* a region whose averager dies mid-all-reduce: both regions return at once with consistent=False;
  one that stalls mid-all-reduce: both return by averaging_timeout (+ shutdown) with consistent=False, and the
  survivor's averager logs how far each stream got (the stalled sender's one part);
* bad arguments (unknown codec, weight <= 0, a Δ with NaN/inf) are refused;
* the next round's averager starts after a round, off the next round's critical path, and only that round
  uses it (a re-synced region's other round starts its own); no round's averager leaves its p2p client's socket
  file in /tmp;
* the step's result is awaited in 0.5 s slices whose timeout is caught also as Python 3.10 raises it
  (concurrent.futures.TimeoutError, a class of its own before 3.11).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import threading
import time

import pytest
import torch
from leftovers import descendants

from ray_diloco.sync import averaging
from ray_diloco.sync.averaging import RegionAverager, RoundResult, round_prefix
from ray_diloco.sync.codecs import get_codec, power_of_two_scale
from ray_diloco.sync.exact_allreduce import ExactAllReduceRunner
from ray_diloco.sync.outer import weighted_average
from ray_diloco.sync.parent_bound import socket_files

MM = 2.0  # matchmaking_seconds in the timing tests
SHAPES = {"emb": (257, 96), "w": (64, 33, 3), "b": (17,), "s": ()}


def make_delta(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    delta = {name: torch.randn(shape, generator=g) * scale for name, shape in SHAPES.items()}
    flat = delta["emb"].view(-1)
    flat[:4] = torch.tensor([1e5, -2e5, 7e4, 65504.0])  # beyond fp16's range: must clamp, never inf
    flat[4:8] = torch.tensor([1e-8, -3e-7, 5e-6, 1e-30])  # fp16 subnormals / underflow
    return delta


def start_regions(n: int, run_id: str = "run", compression: str = "fp16", expected: int | None = None,
                  names: list[str] | None = None, **kwargs) -> list[RegionAverager]:
    names = names or [f"r{i}" for i in range(n)]

    def start(name: str, **peers) -> RegionAverager:
        return RegionAverager(run_id=run_id, region=name, expected_regions=expected or n, compression=compression,
                              **peers, **kwargs)

    started = [start(names[0])]
    try:
        peers = started[0].visible_multiaddrs()
        for name in names[1:]:
            started.append(start(name, initial_peers=peers))
    except BaseException:  # the DHT processes already started would outlive pytest (its exit waits on them)
        shutdown(started)
        raise
    return started


def run_round(calls: list[tuple], timeout: float = 60.0) -> list[RoundResult]:
    """calls: (averager, delta, weight, round_index), run concurrently; results in the same order."""
    results: list = [None] * len(calls)

    def _go(i, averager, delta, weight, round_index):
        try:
            results[i] = averager.average(delta, weight=weight, round_index=round_index)
        except BaseException as e:  # surfaced below
            results[i] = e

    threads = [threading.Thread(target=_go, args=(i, *call), daemon=True) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "average() hung"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def shutdown(averagers):
    for a in averagers:
        a.shutdown()


def timed_round(regions) -> tuple[list[RoundResult], float]:
    """Round 0 of every region (Δ = make_delta(seed=its index), weight 1), its seconds; then all shut down."""
    start = time.monotonic()
    try:
        return run_round([(a, make_delta(seed=i), 1.0, 0) for i, a in enumerate(regions)]), time.monotonic() - start
    finally:
        shutdown(regions)


def assert_identical(results: list[RoundResult]):
    first = results[0]
    for r in results[1:]:
        assert r.digest == first.digest
        for name in first.averaged:
            assert torch.equal(r.averaged[name], first.averaged[name]), name


@pytest.mark.parametrize("n,compression", [(2, "fp16"), (3, "fp16"), (2, "scaled-fp16"), (2, "bf16"),
                                           (2, "none")])
def test_group_gets_bit_identical_weighted_average(n, compression):
    regions = start_regions(n, run_id=f"ident-{n}-{compression}", compression=compression)
    try:
        deltas = [make_delta(seed=10 + i, scale=10.0 ** i) for i in range(n)]
        weights = [1000.0, 3000.0, 2000.0][:n]
        results = run_round([(a, d, w, 0) for a, d, w in zip(regions, deltas, weights)])
    finally:
        shutdown(regions)

    assert_identical(results)
    for r in results:
        assert r.group_size == n and r.consistent and r.error is None
        assert r.peer_regions == [f"r{i}" for i in range(n)]
        assert r.bytes_sent > 0 and r.bytes_received > 0
    got = results[0].averaged
    assert set(got) == set(SHAPES)
    for name, shape in SHAPES.items():
        assert got[name].shape == torch.Size(shape) and got[name].dtype == torch.float32

    codec = get_codec(compression)
    expected = weighted_average(deltas, weights, compression)  # Σ wᵢ·codec(Δᵢ) / Σ wᵢ in fp32
    if compression == "none":
        exact = weighted_average(deltas, weights, "none")
        for name in SHAPES:
            torch.testing.assert_close(got[name], exact[name], rtol=1e-6, atol=1e-6)
        # and the exact fp32 weighted average of the raw Δ (no codec anywhere)
        raw = sum(w * d["w"] for d, w in zip(deltas, weights)) / sum(weights)
        torch.testing.assert_close(got["w"], raw, rtol=1e-6, atol=1e-6)
    else:
        # One more codec rounding of the average; fp32 summation order may move it by one ulp.
        rtol = 2.0 ** -7 if compression == "bf16" else 2.0 ** -10
        for name in SHAPES:
            # scaled-fp16: near 0 one step is fp16's smallest subnormal over the tensor's scale
            atol = max(1e-7, 2.0 ** -24 / power_of_two_scale(expected[name]) if codec.scaled else 0.0)
            torch.testing.assert_close(got[name], codec.roundtrip(expected[name]), rtol=rtol, atol=atol)
    assert all(torch.isfinite(t).all() for t in got.values())
    if compression == "fp16":
        assert got["emb"].abs().max() <= 65504.0
        # 1e5 and 65504 at index 0 and 3 in every region: the clamped average is exactly 65504
        assert got["emb"].view(-1)[0] == 65504.0 and got["emb"].view(-1)[3] == 65504.0
    if compression == "scaled-fp16":  # kept: 1e5 and -2e5 in every region
        assert got["emb"].view(-1)[:2].tolist() == pytest.approx([1e5, -2e5], rel=2.0 ** -10)


def test_scaled_fp16_three_peers_average_large_values_bit_identically():
    regions = start_regions(3, run_id="scaled-3", compression="scaled-fp16")
    fp16 = [RegionAverager(run_id="scaled-3-fp16", region=a.region, expected_regions=3, compression="fp16",
                           dht=a.dht) for a in regions]
    big = torch.full((50_000,), 1e5)  # one wire part per tensor (parts go whole to one reducer)
    deltas = [{"x": big, "y": torch.randn(7)}, {"x": big, "y": torch.randn(7)},
              {"x": torch.zeros(50_000), "y": torch.randn(7)}]
    try:
        results = run_round([(a, d, 1.0, 0) for a, d in zip(regions, deltas)])
        clamped = run_round([(a, d, 1.0, 0) for a, d in zip(fp16, deltas)])
    finally:
        shutdown(fp16 + regions)
    assert_identical(results)
    assert all(r.group_size == 3 and r.consistent for r in results)
    # (1e5 + 1e5 + 0) / 3, within fp16's relative precision (the plain fp16 wire clamps to 65504)
    x = results[0].averaged["x"]
    assert torch.equal(x, torch.full_like(x, x[0].item()))
    assert x[0].item() == pytest.approx(200_000 / 3, rel=2.0 ** -10)
    assert clamped[0].averaged["x"][0].item() == pytest.approx(2 * 65504 / 3, rel=2.0 ** -10)
    # Overhead: each of the 2 parts goes from 2 senders to its reducer and back, 8 messages in all, each
    # with the 4-byte scale, the dtype tag "scaled_float16" instead of "float32" (7 bytes more) and no
    # compression field (NONE is protobuf's default; FLOAT16 takes 2 bytes): 9 bytes per message.
    extra = sum(r.bytes_sent for r in results) - sum(r.bytes_sent for r in clamped)
    assert extra == 8 * (4 + 7 - 2), extra


def test_fp16_sends_half_the_bytes_of_none():
    fp16 = start_regions(2, run_id="bytes-fp16", compression="fp16")
    # The 'none' pair reuses the same two DHT nodes (a different run id keeps the groups apart).
    none = [RegionAverager(run_id="bytes-none", region=a.region, expected_regions=2, compression="none",
                           dht=a.dht) for a in fp16]
    try:
        deltas = [{"x": torch.randn(400_000) * 1e-3}, {"x": torch.randn(400_000) * 1e-3}]
        r16 = run_round([(a, d, 1.0, 0) for a, d in zip(fp16, deltas)])
        r32 = run_round([(a, d, 1.0, 0) for a, d in zip(none, deltas)])
    finally:
        shutdown(none + fp16)
    assert_identical(r16)
    assert_identical(r32)
    total16 = sum(r.bytes_sent for r in r16)
    total32 = sum(r.bytes_sent for r in r32)
    # Each of 2 peers sends half its vector and gets half back: 2 × 400k values cross the wire each way.
    assert total16 == sum(r.bytes_received for r in r16)
    assert 0.98 * 2 * 400_000 * 2 <= total16 <= 1.02 * 2 * 400_000 * 2
    assert 0.98 * 2 * 400_000 * 4 <= total32 <= 1.02 * 2 * 400_000 * 4
    for a, b in zip(r16, r32):
        assert 0.49 <= a.bytes_sent / b.bytes_sent <= 0.51, (a.bytes_sent, b.bytes_sent)


def test_runs_and_rounds_on_one_dht_stay_apart():
    names = ["a1", "a2", "b1", "b2"]
    first = RegionAverager(run_id="run.A", region="a1", expected_regions=2, matchmaking_seconds=MM)
    peers = first.visible_multiaddrs()
    regions = [first] + [
        RegionAverager(run_id="run.A" if n.startswith("a") else "run_A", region=n, expected_regions=2,
                       initial_peers=peers, matchmaking_seconds=MM)
        for n in names[1:]
    ]  # "run.A" and "run_A" sanitise to the same text: the prefix must still tell them apart
    assert round_prefix("run.A", 3) != round_prefix("run_A", 3) and "." not in round_prefix("run.A", 3)
    try:
        deltas = [make_delta(seed=100 + i) for i in range(4)]
        weights = [1000.0, 3000.0, 500.0, 1500.0]
        results = run_round([(a, d, w, 0) for a, d, w in zip(regions, deltas, weights)])
        # Same run, different rounds: neither may average with the other.
        start = time.monotonic()
        late = run_round([(regions[0], deltas[0], 1.0, 1), (regions[1], deltas[1], 1.0, 2)])
        late_seconds = time.monotonic() - start
    finally:
        shutdown(regions)

    ra, rb = results[:2], results[2:]
    assert_identical(ra)
    assert_identical(rb)
    assert [r.peer_regions for r in results] == [["a1", "a2"]] * 2 + [["b1", "b2"]] * 2
    assert ra[0].digest != rb[0].digest
    codec = get_codec("fp16")
    pair_a = weighted_average(deltas[:2], weights[:2], "fp16")
    four = weighted_average(deltas, weights, "fp16")
    torch.testing.assert_close(ra[0].averaged["w"], codec.roundtrip(pair_a["w"]), rtol=2.0 ** -10, atol=1e-7)
    assert not torch.allclose(ra[0].averaged["w"], codec.roundtrip(four["w"]), rtol=1e-2, atol=1e-3)
    pair_b = weighted_average(deltas[2:], weights[2:], "fp16")
    torch.testing.assert_close(rb[0].averaged["w"], codec.roundtrip(pair_b["w"]), rtol=2.0 ** -10, atol=1e-7)

    for r, d in zip(late, deltas[:2]):
        assert r.group_size == 1 and r.peer_regions == [r.peer_regions[0]] and r.consistent
        for name in SHAPES:
            assert torch.equal(r.averaged[name], codec.roundtrip(d[name]))
    assert late_seconds < MM + 6.0


def test_missing_region_round_goes_on_with_those_present():
    regions = start_regions(2, run_id="missing", expected=3, matchmaking_seconds=MM, averaging_timeout=30.0)
    try:
        deltas = [make_delta(seed=1), make_delta(seed=2)]
        start = time.monotonic()
        results = run_round([(a, d, w, 7) for a, d, w in zip(regions, deltas, [1000.0, 3000.0])])
        seconds = time.monotonic() - start
    finally:
        shutdown(regions)
    assert seconds < MM + 6.0, seconds
    assert seconds >= MM - 0.5, "a group short of expected_regions should wait for matchmaking_seconds"
    assert_identical(results)
    for r in results:
        assert r.group_size == 2 and r.peer_regions == ["r0", "r1"] and r.consistent
    expected = get_codec("fp16").roundtrip(weighted_average(deltas, [1000.0, 3000.0], "fp16")["emb"])
    torch.testing.assert_close(results[0].averaged["emb"], expected, rtol=2.0 ** -10, atol=1e-7)


def test_alone_region_gets_its_own_delta_through_the_codec():
    (alone,) = start_regions(1, run_id="alone", expected=2, matchmaking_seconds=MM, averaging_timeout=20.0)
    try:
        delta = make_delta(seed=5)
        start = time.monotonic()
        (result,) = run_round([(alone, delta, 1234.0, 0)])
        seconds = time.monotonic() - start
    finally:
        alone.shutdown()
    assert seconds < MM + 6.0 and result.seconds <= 20.0
    assert result.group_size == 1 and result.peer_regions == ["r0"] and result.consistent
    assert result.bytes_sent == result.bytes_received == 0
    codec = get_codec("fp16")
    for name in SHAPES:
        assert torch.equal(result.averaged[name], codec.roundtrip(delta[name]))


def test_a_reducer_stays_until_its_last_reply_is_in(monkeypatch):
    """r1 reads r0's averaged parts slowly (a slow link into r1, or a busy host): r0's handler has written
    every reply long before r1 has read them. If r0's handler ends then, r0's p2p daemon closes the stream and
    resets it, and the replies still buffered at r1's daemon are dropped: r1 lost a part (a 50 Mbit/s WAN run,
    1 round in 15; test_slow_region under CI load). r1 must end its request stream only once it holds every
    reply, and r0's round must last until then."""
    per_reply = 0.3
    regions = start_regions(2, run_id="ack", matchmaking_seconds=MM, averaging_timeout=60.0, part_size_bytes=2**16)
    slow_reducer = regions[0].dht.peer_id  # set before the averagers fork: they inherit the patch
    original = ExactAllReduceRunner._decode_reply

    def slowly(peer_id, msg):
        if peer_id == slow_reducer:
            time.sleep(per_reply)
        return original(peer_id, msg)

    monkeypatch.setattr(ExactAllReduceRunner, "_decode_reply", staticmethod(slowly))
    deltas = [{"w": torch.randn(2_000_000, generator=torch.Generator().manual_seed(i))} for i in range(2)]
    try:
        rounds = [run_round([(a, deltas[i], 1.0, r) for i, a in enumerate(regions)]) for r in range(2)]
    finally:
        shutdown(regions)
    for fast, slow in rounds:
        assert fast.consistent and slow.consistent, (fast.error, slow.error)
        assert_identical([fast, slow])
        # r0 reduces half of 2M values, fp16 in 64 KiB parts: ~16 replies, read slowly by r1 (a few at once)
        assert slow.seconds > 10 * per_reply
        assert fast.seconds > 0.8 * slow.seconds, (fast.seconds, slow.seconds)


def test_region_dying_mid_round_is_reported_inconsistent(monkeypatch):
    regions = start_regions(2, run_id="drop", averaging_timeout=15.0, part_size_bytes=2**12)
    victim = regions[1].dht.peer_id
    original = ExactAllReduceRunner._generate_input_for_peer

    async def send_two_parts_then_die(self, peer_index):
        sent = 0
        async for msg in original(self, peer_index):
            yield msg
            sent += 1
            if self.peer_id == victim and sent == 2:  # runs in the victim's forked averager process
                await asyncio.sleep(0.05)
                os._exit(1)

    monkeypatch.setattr(ExactAllReduceRunner, "_generate_input_for_peer", send_two_parts_then_die)
    (survivor, dead), seconds = timed_round(regions)
    assert seconds < 10.0, "a dead peer must not hold the round until averaging_timeout"
    # Depending on timing the survivor lost the victim as a reducer, as a sender, or both.
    assert not survivor.consistent and ("dropped" in survivor.error or "reducer failed" in survivor.error)
    assert survivor.group_size == 2
    assert not dead.consistent and "died" in dead.error and dead.group_size == 1
    # the dead region falls back to its own Δ through the codec
    assert torch.equal(dead.averaged["w"], get_codec("fp16").roundtrip(make_delta(seed=1)["w"]))


def test_a_reducer_dying_before_its_last_reply_fails_the_round_at_once(monkeypatch):
    """r1 dies as a reducer after it has every part of r0's (its last reply never goes out). r0 has sent
    everything and waits only for replies: it must see the stream end and return at once, not at
    averaging_timeout (an acknowledgement that held the request stream open did that; not kept)."""
    timeout = 30.0
    regions = start_regions(2, run_id="die-late", matchmaking_seconds=MM, averaging_timeout=timeout,
                            part_size_bytes=2**12)
    victim = regions[1].dht.peer_id
    original = ExactAllReduceRunner._accumulate_parts_streaming

    async def die_before_the_last_reply(self, stream, sender_index):
        replied = 0
        async for msg in original(self, stream, sender_index):
            if self.peer_id == victim and replied == self.tensor_part_reducer.num_parts - 1:
                os._exit(1)  # in the victim's forked averager process: every part is in, the last reply is not out
            yield msg
            replied += 1

    monkeypatch.setattr(ExactAllReduceRunner, "_accumulate_parts_streaming", die_before_the_last_reply)
    (survivor, dead), seconds = timed_round(regions)
    assert seconds < 10.0, f"{seconds:.1f} s: the survivor waited for a dead reducer"
    assert not survivor.consistent and "reducer failed" in survivor.error
    assert not dead.consistent


def test_region_stalling_mid_round_cannot_hold_the_round_past_the_timeout(monkeypatch, capfd):
    timeout = 6.0
    regions = start_regions(2, run_id="stall", matchmaking_seconds=MM, averaging_timeout=timeout,
                            part_size_bytes=2**12)
    victim = regions[1].dht.peer_id
    original = ExactAllReduceRunner._generate_input_for_peer

    async def send_one_part_then_hang(self, peer_index):
        async for msg in original(self, peer_index):
            yield msg
            if self.peer_id == victim:
                await asyncio.sleep(3600)

    monkeypatch.setattr(ExactAllReduceRunner, "_generate_input_for_peer", send_one_part_then_hang)
    results, seconds = timed_round(regions)  # the averagers log to stderr (tests/conftest.py)
    assert seconds < timeout + 5.0, seconds
    for r, seed in zip(results, (0, 1)):
        assert not r.consistent and "averaging_timeout" in r.error and r.seconds < timeout + 5.0
        assert torch.equal(r.averaged["b"], get_codec("fp16").roundtrip(make_delta(seed=seed)["b"]))
    # Each round's averager says where its streams stood: the survivor got at most the victim's first part.
    logged = capfd.readouterr().err
    # (its one part, or none where it had not come in by the timeout, on a loaded machine)
    assert "All-reduce ended by" in logged and re.search(f"from sender {victim}: [01] of [0-9]+ part", logged), \
        logged[-3000:]


class _FakeAverager:
    def is_alive(self):
        return True


class _Py310Control:
    """A step control whose result(timeout=…) times out twice the way Python 3.10 does, then returns."""

    def __init__(self):
        self.calls = 0

    def done(self):
        return False

    def result(self, timeout=None):
        self.calls += 1
        if self.calls <= 2:
            raise concurrent.futures.TimeoutError()
        return "value"


def test_await_step_waits_through_futures_timeouts(monkeypatch):
    # On 3.11+ concurrent.futures.TimeoutError *is* the builtin; 3.10 has a class of its own (an
    # Exception, not an OSError). Stand one in so this test also catches the regression on 3.11.
    class FuturesTimeoutError(Exception):
        pass

    monkeypatch.setattr(concurrent.futures, "TimeoutError", FuturesTimeoutError)
    control = _Py310Control()
    assert averaging._await_step(control, _FakeAverager(), time.monotonic() + 10.0) == "value"
    assert control.calls == 3


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="compression"):
        RegionAverager(run_id="x", region="r", expected_regions=2, compression="int8")
    with pytest.raises(ValueError, match="averaging_timeout"):
        RegionAverager(run_id="x", region="r", expected_regions=2, matchmaking_seconds=10, averaging_timeout=5)
    single = RegionAverager(run_id="x", region="r", expected_regions=1)
    try:
        with pytest.raises(ValueError, match="weight"):
            single.average({"x": torch.ones(3)}, weight=0.0, round_index=0)
        with pytest.raises(ValueError, match="2 non-finite"):
            single.average({"x": torch.tensor([1.0, float("nan")]), "y": torch.tensor([float("inf")])},
                           weight=1.0, round_index=0)
        # One expected region: no wire, the codec's rounding only.
        x = torch.tensor([1e5, 1e-3, 1.0])
        r = single.average({"x": x}, weight=1.0, round_index=0)
        assert r.group_size == 1 and r.consistent and torch.equal(r.averaged["x"], get_codec("fp16").roundtrip(x))
        assert r.averaged["x"][0] == 65504.0
    finally:
        single.shutdown()


def test_the_next_rounds_averager_is_started_after_a_round_and_used_only_by_that_round():
    """Rounds 0, 1, 3: round 1 takes the averager started after round 0 (no start on its critical path);
    round 3 is not the prepared round 2, so it starts its own (the prepared one is shut down). Every round
    still gathers both regions with identical results. No averager leaves its p2p client's socket file behind."""
    # Not a timing test: a group fills (and starts) as soon as both regions are in, so a generous bound costs
    # nothing here and keeps a loaded machine's slow join from making a group of one (CI once failed this test).
    regions = start_regions(2, run_id="prepared", matchmaking_seconds=5.0)
    started = {region.region: [] for region in regions}  # (round, started ahead by _prepare?)
    clients: set[str] = set()  # socket files of the prepared averagers' p2p clients (the DHTs' listen on none)
    for region in regions:
        def counted(key, deadline, start=region._start_averager, name=region.region):
            started[name].append((key[0], threading.current_thread().name.endswith("(_prepare)")))
            return start(key, deadline)
        region._start_averager = counted
    try:
        results = {}
        for round_index in (0, 1, 3):
            results[round_index] = run_round([(r, make_delta(i + 10 * round_index), 1.0, round_index)
                                              for i, r in enumerate(regions)])
            for r in regions:  # as the inner steps would: the preparation has time to finish
                r._preparing.join()
            clients |= socket_files(descendants(os.getpid()), "hivemind-p2pclient")
    finally:
        shutdown(regions)
    for round_results in results.values():
        assert [r.group_size for r in round_results] == [2, 2]
        assert_identical(round_results)
    for region in regions:
        assert started[region.region] == [(0, False), (1, True), (2, True), (3, False), (4, True)], started
    assert all(r._prepared is None for r in regions)  # shut down with the regions
    # Each averager's process made its own client of its DHT's p2p daemon, and a socket file for it; stock hivemind
    # left every one in /tmp (one per round and region).
    assert len(clients) >= 2 * 3, clients  # the prepared averagers of rounds 1, 2 and 4, in both regions
    assert not [path for path in clients if os.path.exists(path)]
