"""Regions find each other through peer files in the run's storage (ray_diloco.sync.peers), real DHTs on 127.0.0.1.

* a peer file round-trips (local directory), the reader skips its own region and a malformed file, and a
  missing directory reads as no peers;
* a DHT started alone connects to another through the multiaddrs in its file, after which a value one stores
  is read by the other;
* an address from an earlier run (nobody listening) gives False within the timeout instead of an error.
"""

import time

from hivemind import DHT
from hivemind.utils import get_dht_time

from ray_diloco.sync.peers import connect, read_peer_files, write_peer_file


def test_peer_files_round_trip(tmp_path):
    directory = str(tmp_path / "run" / "peers")
    assert read_peer_files(directory, exclude="us") == {}
    write_peer_file(directory, "us", ["/ip4/127.0.0.1/tcp/1/p2p/x"])
    write_peer_file(directory, "eu", ["/ip4/127.0.0.1/tcp/2/p2p/y"])
    (tmp_path / "run" / "peers" / "ap.json").write_text("{not json")
    assert read_peer_files(directory, exclude="us") == {"eu": ["/ip4/127.0.0.1/tcp/2/p2p/y"]}
    write_peer_file(directory, "eu", ["/ip4/127.0.0.1/tcp/3/p2p/z"])  # a restarted region replaces its file
    assert read_peer_files(directory, exclude="us")["eu"] == ["/ip4/127.0.0.1/tcp/3/p2p/z"]


def test_two_lone_dhts_meet_through_a_peer_file(tmp_path):
    first = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        directory = str(tmp_path / "peers")
        write_peer_file(directory, "first", [str(m) for m in first.get_visible_maddrs()])
        assert second.get("meeting") is None
        (found,) = read_peer_files(directory, exclude="second").values()
        assert connect(second, found)
        second.store("meeting", "hello", get_dht_time() + 60)
        assert first.get("meeting").value == "hello"

        gone = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # a region of an earlier run
        dead = [str(m) for m in gone.get_visible_maddrs()]
        gone.shutdown()
        started = time.monotonic()
        assert not connect(first, dead, timeout=10)
        assert time.monotonic() - started < 12
    finally:
        first.shutdown()
        second.shutdown()


def test_the_private_hivemind_call_we_dial_with_is_still_there():
    """`peers._connect` dials through `P2P._client.connect(peer_id, maddrs)` (hivemind has no public call for a
    running node): this fails first, by name, when a hivemind release moves it."""
    import inspect

    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings.p2pclient import Client

    assert list(inspect.signature(Client.connect).parameters) == ["self", "peer_id", "maddrs"]
    assert inspect.iscoroutinefunction(Client.connect)
    assert "_client" in vars(P2P()) and not hasattr(P2P, "connect")  # still private, still no public one
