"""The all-gather of a compressed round: every region of the group fetches every other region's payload.

Compressed payloads (ray_diloco.methods) are not averaged element-wise on the wire: the sum of two sparse
selections is no longer sparse, and its values are no longer 2-bit. So a round of a compressed method is:

1. the region offers its payload for the round here (served from the region's own p2p daemon);
2. Hivemind's matchmaking forms the round's group as for dense DiLoCo (same prefix, timeouts, join gate), and
   each member's gathered metadata carries its payload's size, blake2b digest and tokens. The leader hands every
   member the same list, so every member knows the same group and what each member will serve;
3. each member fetches the others' payloads (`fetch`), checks size and digest against that list before a byte is
   decoded, and decodes and sums them in the order of the regions' names (Compressor.aggregate).

A payload is served only to peers of that round's group (a request that arrives before our own matchmaking
ended waits for it), so only regions the join gate admitted can read it. `served` counts the payload bytes of the
streams members read to the end, once per member and round (the libp2p and protobuf framing is not counted).

Transport as StateSharer: a libp2p stream handler of our own on the DHT's daemon (`p2p_service.StreamService`),
the payload in `chunk_bytes` messages.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import defaultdict

from hivemind import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.asyncio import aiter_with_timeout

from ray_diloco.sync.averaging import safe_name
from ray_diloco.sync.p2p_service import StreamService

logger = logging.getLogger(__name__)
KEEP_ROUNDS = 2  # payloads of older rounds are dropped: a member fetches within its round


def payload_digest(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


class PayloadExchange:
    def __init__(self, dht: DHT, run_id: str, region: str, *, chunk_bytes: int = 2**19,
                 chunk_timeout: float = 30.0):
        self.run_id, self.region = run_id, region
        self.chunk_bytes, self.chunk_timeout = int(chunk_bytes), float(chunk_timeout)
        self._offered: dict[int, bytes] = {}
        self._groups: dict[int, set[PeerID]] = {}
        self._group_set: dict[int, asyncio.Event] = defaultdict(asyncio.Event)  # used on our loop only
        self.served_bytes: dict[int, int] = defaultdict(int)  # round -> bytes of the streams members read to the end
        self.served_peers: dict[int, set[PeerID]] = defaultdict(set)  # round -> members that read it to the end
        self.open_streams = 0  # streams being served now (a fork while one is open would hold it open)
        self.refused = 0  # requests from peers outside the round's group (or for rounds we do not hold)
        self._service = StreamService(dht, self._handler_name(region), self._serve, averaging_pb2.DownloadData,
                                      thread_name=f"payloads-{region}")
        self._run = self._service.run

    def _handler_name(self, region: str) -> str:
        return f"diloco_{safe_name(self.run_id)}_payload::{safe_name(region)}"

    # -- our side ---------------------------------------------------------------------------------------
    def offer(self, round_index: int, payload: bytes) -> None:
        """Serve `payload` as ours for `round_index` (to its group, once known); older rounds are dropped."""
        async def store():
            self._offered[round_index] = payload
            for old in [r for r in self._offered if r <= round_index - KEEP_ROUNDS]:
                for kept in (self._offered, self._groups, self._group_set, self.served_bytes, self.served_peers):
                    kept.pop(old, None)
        self._run(store(), timeout=10.0)

    def set_group(self, round_index: int, peers: list[str]) -> None:
        """The peers (base58) of the round's group: the only ones its payload is served to."""
        async def store():
            self._groups[round_index] = {PeerID.from_base58(peer) for peer in peers}
            self._group_set[round_index].set()
        self._run(store(), timeout=10.0)

    async def _serve(self, request: averaging_pb2.DownloadData, context: P2PContext):
        try:
            round_index = int(MSGPackSerializer.loads(request.metadata)["round"])
        except Exception:  # noqa: BLE001 — a malformed request gets an empty stream
            self.refused += 1
            return
        if round_index not in self._offered:
            self.refused += 1
            return
        try:  # a member may ask before our own matchmaking has ended (its own ended first): wait for the group
            await asyncio.wait_for(self._group_set[round_index].wait(), self.chunk_timeout)
        except asyncio.TimeoutError:
            pass
        payload = self._offered.get(round_index)
        if payload is None or context.remote_id not in self._groups.get(round_index, ()):
            self.refused += 1
            logger.warning("[%s] refused round %d's payload to %s: not in the round's group", self.region,
                           round_index, context.remote_id)
            return
        self.open_streams += 1
        try:
            for offset in range(0, len(payload), self.chunk_bytes):
                chunk = payload[offset:offset + self.chunk_bytes]
                yield averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=chunk))
            if context.remote_id not in self.served_peers[round_index]:
                self.served_peers[round_index].add(context.remote_id)
                self.served_bytes[round_index] += len(payload)
        finally:
            self.open_streams -= 1

    # -- theirs -----------------------------------------------------------------------------------------
    async def _fetch(self, peer: PeerID, region: str, round_index: int, size: int, digest: str) -> bytes:
        request = averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps({"round": int(round_index)}))
        stream = await self._service.p2p.iterate_protobuf_handler(peer, self._handler_name(region), request,
                                                          averaging_pb2.DownloadData)
        received = bytearray()
        try:
            async for message in aiter_with_timeout(stream, self.chunk_timeout):
                if len(received) + len(message.tensor_part.buffer) > size:
                    raise ValueError(f"{region} sent more than the {size} bytes it announced")
                received += message.tensor_part.buffer
        finally:
            await stream.aclose()
        if len(received) != size or payload_digest(bytes(received)) != digest:
            raise ValueError(f"{region}'s payload ({len(received)} bytes) does not match its announced size "
                             f"{size} and digest")
        return bytes(received)

    def fetch_all(self, wanted: list[tuple[str, str, int, str]], round_index: int,
                  timeout: float) -> dict[str, bytes | BaseException]:
        """(peer base58, region, size, digest) -> region: its checked payload, or why it failed; in parallel,
        all within `timeout` seconds."""
        async def fetch_every():
            tasks = [self._fetch(PeerID.from_base58(peer), region, round_index, size, digest)
                     for peer, region, size, digest in wanted]
            return await asyncio.gather(*(asyncio.wait_for(t, timeout) for t in tasks), return_exceptions=True)
        results = self._run(fetch_every(), timeout=timeout + 5.0)
        return {region: result for (_, region, _, _), result in zip(wanted, results)}

    def wait_served(self, round_index: int, members: int, timeout: float) -> bool:
        """Wait until `members` peers have read our round's payload to its end and no stream is open, up to
        `timeout`: the round's count is then complete, a last round does not stop serving under a slower member,
        and the next round's averager can be forked without holding a stream open."""
        deadline = time.monotonic() + timeout
        while len(self.served_peers.get(round_index, ())) < members or self.open_streams:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def served(self, round_index: int) -> int:
        return self.served_bytes.get(round_index, 0)

    def shutdown(self) -> None:
        self._service.shutdown(f"[{self.region}] the payload exchange")
