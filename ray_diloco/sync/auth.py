"""Run membership: only the holders of the run's secret take part.

Every region of a run is given the same secret (`outer.secret_file`, `--secret-file`: at least 32 bytes, e.g.
`openssl rand -hex 32`). It never enters the config, a log or a summary: the driver reads the file and hands the
bytes to its SyncActors.

- **Records.** Every DHT record a region stores is extended with an HMAC-SHA256 over (key, subkey, value,
  expiration time) under a key derived from the secret and the run's name (`RecordAuthenticator`, a hivemind
  record validator). A node checks every record it is asked to store and every record another node returns: an
  outsider's store is refused by every honest node, and an answer holding a record without a valid MAC is dropped
  whole. This covers our state records (who holds which state, in which phase) and hivemind's matchmaking
  declarations alike: an outsider can neither forge a record nor announce itself as a group to join.
- **Peers.** libp2p authenticates a peer's ID on every connection (the peer proves it holds the ID's private key
  in the noise handshake). A peer is a member when a valid record of the run names its ID: each region's state
  record carries its peer ID, and only a secret holder can write one. Matchmaking requests and state downloads are
  answered for members only (`MemberGate`); the all-reduce itself runs within a group only members could join.
  A refused peer is counted and logged once; the SyncActor makes it an event (`peer_rejected`).

What this does not stop: a secret holder (trusted, like the bucket's writers: see the README's threat model), a
replay of a member's still-valid record (it says what the member said), or an outsider flooding a region's port.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import struct
import time
from collections import Counter
from collections.abc import Callable

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

MAC_MARKER = b"\x00rd-hmac1"  # a version tag before the MAC: a record signed otherwise never parses as ours
MAC_BYTES = hashlib.sha256().digest_size
SUFFIX_BYTES = len(MAC_MARKER) + MAC_BYTES


class RecordAuthenticator(RecordValidatorBase):
    """Signs the records this node stores and accepts only records signed under the same run key."""

    def __init__(self, secret: bytes, run_id: str):
        # One key per run: a record of another run under the same secret never validates here.
        self._key = hmac.new(secret, b"ray-diloco records\x00" + run_id.encode(), hashlib.sha256).digest()
        self.refused = 0  # records that failed the check (another node's answer, or a store asked of us)

    def _mac(self, record: DHTRecord, value: bytes) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in (record.key, record.subkey, value):  # length-prefixed: no two records share a message
            mac.update(struct.pack(">Q", len(part)))
            mac.update(part)
        mac.update(struct.pack(">d", record.expiration_time))
        return mac.digest()

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + MAC_MARKER + self._mac(record, record.value)

    def validate(self, record: DHTRecord) -> bool:
        value = record.value
        if len(value) < SUFFIX_BYTES or value[-SUFFIX_BYTES:-MAC_BYTES] != MAC_MARKER:
            self.refused += 1
            return False
        if not hmac.compare_digest(value[-MAC_BYTES:], self._mac(record, value[:-SUFFIX_BYTES])):
            self.refused += 1
            return False
        return True

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value[:-SUFFIX_BYTES]

    @property
    def priority(self) -> int:
        return 10  # signs last and checks first: nothing else reads a record before its MAC is checked


def members_named(found) -> set[PeerID]:
    """The peer IDs that the run's state records (a DHT dictionary value, already validated) name."""
    members: set[PeerID] = set()
    if found is None or not isinstance(found.value, dict):
        return members
    for item in found.value.values():
        value = getattr(item, "value", None)
        if isinstance(value, dict) and isinstance(value.get("peer_id"), str):
            try:
                members.add(PeerID.from_base58(value["peer_id"]))
            except ValueError:
                continue
    return members


def member_keys(members_key: str) -> tuple[str, str]:
    """Where members are named: the run's state records, and the records of regions joining it (a region asks for
    the run's state before it publishes a state record of its own: `announce_joining`)."""
    return members_key, f"{members_key}_joining"


async def read_members(dht, members_key: str) -> set[PeerID]:
    """The peers the run's signed records name now (validated by the DHT's RecordAuthenticator)."""
    found = [await asyncio.wrap_future(dht.get(key, latest=True, return_future=True))
             for key in member_keys(members_key)]
    return set().union(*(members_named(f) for f in found))


def announce_joining(dht, members_key: str, region: str, ttl: float, timeout: float) -> bool:
    """Name our peer in a signed record before we have a state record, so that the regions we download the run's
    state from, or whose round we join, admit us. It expires after `ttl`; by then our state record names us."""
    key = member_keys(members_key)[1]
    return bool(dht.store(key, subkey=region, value={"peer_id": dht.peer_id.to_base58()},
                          expiration_time=get_dht_time() + ttl, return_future=True).result(timeout))


class MemberGate:
    """Whether a peer may be served: a member of the run (a valid state record names it). `members`: those known
    already (a round's averager starts with its region's list: the first join of a round waits for no lookup).
    An unknown peer's request starts a DHT read, at most once per `refresh_seconds`, and every request arriving
    meanwhile waits for that same read, up to `lookup_seconds` (below Hivemind's join request timeout): a region
    that just joined is admitted, a stranger costs one read per period, not one per request."""

    def __init__(self, dht, members_key: str, region: str, refresh_seconds: float = 1.0,
                 on_reject: Callable[[PeerID, str], None] | None = None, members=(),
                 lookup_seconds: float = 1.5):
        self.dht, self.members_key, self.region = dht, members_key, region
        self.refresh_seconds, self.lookup_seconds = float(refresh_seconds), float(lookup_seconds)
        self.on_reject = on_reject
        self.members: set[PeerID] = set(members)
        self.rejected: Counter[str] = Counter()  # peer (base58) -> refused requests
        self._refreshed = float("-inf")
        self._lookup: asyncio.Future | None = None  # the DHT read under way, shared by every waiting request

    async def _refresh(self) -> None:
        try:
            # Kept, never replaced: a read that missed a record (a node slow to answer) must not turn a member
            # away, and a region that left still held the secret.
            self.members |= await read_members(self.dht, self.members_key)
        except Exception as error:  # noqa: BLE001 — the DHT shutting down: keep what we knew
            logger.debug("[%s] reading the members failed: %r", self.region, error)
        finally:
            self._lookup = None

    async def admits(self, peer: PeerID, what: str) -> bool:
        if peer in self.members:
            return True
        if self._lookup is None and time.monotonic() - self._refreshed >= self.refresh_seconds:
            self._refreshed = time.monotonic()
            self._lookup = asyncio.ensure_future(self._refresh())
        if self._lookup is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._lookup), self.lookup_seconds)
            except asyncio.TimeoutError:
                pass
        if peer in self.members:
            return True
        name = peer.to_base58()
        self.rejected[name] += 1
        if self.rejected[name] == 1:
            logger.warning("[%s] refused %s from peer %s: no valid record of this run names it", self.region,
                           what, name)
            if self.on_reject is not None:
                self.on_reject(peer, what)
        return False
