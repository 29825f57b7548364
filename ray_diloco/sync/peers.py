"""Regions find each other through the run's storage, not through copied multiaddrs.

Each region's SyncActor writes the multiaddrs its Hivemind node can be reached at to
`<peers dir>/<region>.json` (a local path, or `s3://` / `gs://` through `pyarrow.fs`: the storage every
cluster of the run already shares for checkpoints) and connects to the multiaddrs the other regions wrote.
Connections are made after the node started, not as its bootstrap peers: a file left by an earlier run (dead
addresses) then costs a logged failed dial instead of a failed start, and two regions that started at the same
moment (neither saw the other's file yet) still meet, since each keeps reading the files while it waits.
`outer.initial_peers` (or `--initial-peers`) still works and is used as the bootstrap peers when given.
"""

from __future__ import annotations

import json
import logging
import time

import pyarrow.fs as pafs

from ray_diloco.data.files import resolve_filesystem
from ray_diloco.sync.durable import write_atomically

logger = logging.getLogger(__name__)


def write_peer_file(directory: str, region: str, maddrs: list[str]) -> str:
    """Write (replace) this region's multiaddrs. Returns the file's location."""
    payload = json.dumps({"region": region, "multiaddrs": maddrs, "written": time.time()}).encode()
    return write_atomically(directory, f"{region}.json", payload)


def read_peer_files(directory: str, exclude: str) -> dict[str, list[str]]:
    """The other regions' multiaddrs by region; unreadable or malformed files are logged and skipped."""
    fs, path = resolve_filesystem(directory)
    found: dict[str, list[str]] = {}
    for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        if info.type != pafs.FileType.File or not info.base_name.endswith(".json"):
            continue
        region = info.base_name[:-len(".json")]
        if region == exclude:
            continue
        try:
            with fs.open_input_stream(info.path) as stream:
                record = json.loads(stream.read())
            found[region] = [str(m) for m in record["multiaddrs"]]
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("skipping the peer file %s: %r", info.path, error)
    return found


async def _connect(dht, node, maddrs: list[str]) -> bool:
    """Runs in the DHT's process: dial a peer, add it to the routing table, then look up our own neighbours
    (what hivemind's bootstrap does with initial peers)."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    addresses = [Multiaddr(m) for m in maddrs]
    peer_id = PeerID.from_base58(addresses[0]["p2p"])
    if peer_id == node.peer_id:
        return True
    try:
        # Private: hivemind 1.1's public API dials peers only at start (`initial_peers` of DHT/P2P.create); a
        # running node has no public way to reach a new address (P2P offers list_peers, wait_for_at_least_n_peers,
        # get_visible_maddrs). So we use the daemon client's CONNECT, as hivemind itself does in
        # P2P.is_identity_taken. What we rely on is pinned by tests/test_peers.py (hivemind is bounded <1.2).
        await node.p2p._client.connect(peer_id, [a.decapsulate(Multiaddr(f"/p2p/{a['p2p']}")) for a in addresses])
    except Exception:  # noqa: BLE001 — nobody there (an old file, a peer that left): the caller logs it
        return False
    if await node.protocol.call_ping(peer_id) is None:
        return False
    await node.find_nearest_nodes([node.node_id])
    return True


def connect(dht, maddrs: list[str], timeout: float = 15.0) -> bool:
    """Connect a running hivemind DHT to the peer at `maddrs` (one peer's addresses). False if it did not answer."""
    from functools import partial

    try:
        return bool(dht.run_coroutine(partial(_connect, maddrs=maddrs), return_future=True).result(timeout))
    except Exception as error:  # a dead address from an earlier run, a peer behind NAT, ...
        logger.info("could not reach the peer at %s: %r", maddrs[:1], error)
        return False
