"""The all-gather of compressed rounds (ray_diloco.sync.payloads, ray_diloco.sync.compressed): who is in a round's
sum, and what a payload must be before it is used.

* `_checked_members` leaves out, on every member alike, a peer whose metadata is malformed (not a mapping,
  missing fields, tokens not a positive int or more than the run's largest region trains in a round, a payload of another size or decoder) and both claims of a region
  claimed twice; the rest comes back sorted by region, the one order every member sums in;
* on two real DHT nodes: a member of the round fetches the payload and it is counted as served once it was read
  to its end; a peer outside the round's group is refused (an empty stream, counted); a payload whose bytes do
  not match the announced digest or size is refused by the fetcher.
"""

from __future__ import annotations

import pytest
from hivemind import DHT

from ray_diloco.sync.compressed import _checked_members
from ray_diloco.sync.payloads import PayloadExchange, payload_digest

DIGEST = "0" * 32


def meta(region, tokens=10, size=100, decoder="d", digest=DIGEST):
    return {"region": region, "tokens": tokens, "payload_bytes": size, "payload_digest": digest, "decoder": decoder}


def test_members_with_malformed_or_conflicting_metadata_are_left_out():
    members = [("p1", meta("b")), ("p2", meta("a")), ("p3", "not a mapping"), ("p4", {"region": "c"}),
               ("p5", meta("d", tokens=0)), ("p6", meta("e", tokens=1.5)), ("p7", meta("f", size=99)),
               ("p8", meta("g", decoder="other")), ("p9", meta("h", digest="short")),
               ("p10", meta("x")), ("p11", meta("x")), ("p12", meta("i", tokens=1001)),
               ("p13", meta("j", tokens=1000))]
    valid, left_out = _checked_members(members, size=100, decoder="d", max_tokens=1000)
    assert valid == [("p2", "a", 10, DIGEST), ("p1", "b", 10, DIGEST), ("p13", "j", 1000, DIGEST)]
    assert sorted(left_out) == sorted(f"p{i}" for i in range(3, 13))


@pytest.fixture(scope="module")
def two_nodes():
    a = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    b = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in a.get_visible_maddrs()])
    exchanges = PayloadExchange(a, "run", "ra", chunk_timeout=5.0), PayloadExchange(b, "run", "rb", chunk_timeout=5.0)
    yield (a, b), exchanges
    for exchange in exchanges:
        exchange.shutdown()
    a.shutdown(), b.shutdown()


def test_only_the_rounds_group_reads_a_payload_and_its_bytes_are_checked(two_nodes):
    (a, b), (ours, theirs) = two_nodes
    payload = bytes(range(256)) * 3000  # two chunks of the stream
    ours.offer(0, payload)
    ours.set_group(0, [str(a.peer_id), str(b.peer_id)])
    wanted = (str(a.peer_id), "ra", len(payload), payload_digest(payload))
    assert theirs.fetch_all([wanted], 0, timeout=10)["ra"] == payload
    assert ours.wait_served(0, 1, timeout=5) and ours.served(0) == len(payload)
    for wrong in ((*wanted[:3], payload_digest(b"other")), (*wanted[:2], len(payload) - 1, wanted[3])):
        assert isinstance(theirs.fetch_all([wrong], 0, timeout=10)["ra"], ValueError)

    ours.offer(1, payload)
    ours.set_group(1, [str(a.peer_id)])  # rb is not in round 1's group
    refused = ours.refused
    result = theirs.fetch_all([(str(a.peer_id), "ra", len(payload), payload_digest(payload))], 1, timeout=10)["ra"]
    assert isinstance(result, ValueError) and ours.refused == refused + 1 and ours.served(1) == 0
