"""Sharing the outer state between regions: who holds what, which state is canonical, and loading it.

Every region publishes a `StateRecord` in the DHT under a run-scoped key (subkey = region, value also carries
its p2p peer id); `ray_diloco.sync.policy` decides from them; `StateSharer.load_from_peers`
downloads (outer_step, θ_global, momentum) from a region whose record matches the wanted one.

Transport: one libp2p stream handler per region on the DHT's own p2p daemon (`p2p_service.StreamService`, served
from an asyncio thread of its own, in this process). Not hivemind's averager state sharing: it picks the donor by
priority (we need the holder of one digest), runs in a forked child and copies the whole state into shared
memory per request. The state goes as raw bytes (exact, any dtype) in `chunk_bytes` messages after a small
header (step, digest, names, dtypes, shapes). The client checks the header's step/digest, then the digests of
the θ and the momentum it received against the record, and moves on to the next holder of the wanted digests on
any failure or mismatch.

Served state (consistency): by default (`snapshot=True`) `publish()` takes the state once — `get_state()` in
the publishing thread, or the `state=` it is handed — checks step and digest against the record and serves
that frozen copy until the next publish, so what is served always matches the published record; a download
under way during a publish finishes the old, consistent copy. `snapshot=False` (no extra copy in memory):
`get_state()` runs in the sharer's thread per request and must return a consistent, thread-safe snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable, Mapping

import numpy as np
import torch
from hivemind import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout

from ray_diloco.sync.auth import MemberGate
from ray_diloco.sync.averaging import safe_name
from ray_diloco.sync.outer import state_digest
from ray_diloco.sync.p2p_service import StreamService
from ray_diloco.sync.policy import PHASES, StateRecord, choose_canonical, parse_record

logger = logging.getLogger(__name__)

State = tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]


def state_key(run_id: str) -> str:
    """DHT key of a run's state records (two runs on one DHT never share it)."""
    return f"diloco_{safe_name(run_id)}_state"


@dataclass(frozen=True)
class _Served:
    outer_step: int
    digest: str
    tensors: tuple[tuple[str, str, torch.Tensor], ...]  # (kind 'theta' | 'momentum', name, contiguous CPU tensor)


def _freeze(state: State, copy: bool, digest: str | None = None) -> _Served:
    def prepare(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().cpu()
        return t.clone(memory_format=torch.contiguous_format) if copy else t.contiguous()

    step, theta, momentum = state
    items = tuple(("theta", n, prepare(t)) for n, t in theta.items())
    items += tuple(("momentum", n, prepare(t)) for n, t in momentum.items())
    if digest is None:
        digest = state_digest({n: t for kind, n, t in items if kind == "theta"})
    return _Served(int(step), digest, items)


Schema = Mapping[str, tuple[tuple[int, ...], str]]  # parameter name -> (shape, dtype name)


def check_header(header: dict, schema: Schema) -> list[tuple[str, str, torch.Size, torch.dtype]]:
    """The tensors a peer announces, checked against this model's own parameters before anything is allocated
    (a peer's numbers never size an allocation): θ_global holds every parameter once, momentum each parameter at
    most once (none before the first outer step), each with the parameter's shape and dtype, in the order they
    will be sent. Returns (kind, name, shape, dtype) from our schema; ValueError naming the first mismatch."""
    tensors = header.get("tensors")
    if not isinstance(tensors, list):
        raise ValueError("the peer's state header lists no tensors")
    checked, seen = [], {"theta": set(), "momentum": set()}
    for entry in tensors:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 4 and entry[0] in seen and entry[1] in schema):
            raise ValueError(f"the peer announces a tensor this model does not have: {str(entry)[:100]}")
        kind, name, dtype, shape = entry
        want_shape, want_dtype = schema[name]
        if name in seen[kind] or dtype != want_dtype or not isinstance(shape, (list, tuple)) or tuple(
                shape) != tuple(want_shape):
            raise ValueError(f"the peer announces {kind} {name} as {str(dtype)[:20]} {str(shape)[:60]}, not once "
                             f"as {want_dtype} {list(want_shape)}")
        seen[kind].add(name)
        checked.append((kind, name, torch.Size(want_shape), getattr(torch, want_dtype)))
    if seen["theta"] != set(schema):
        raise ValueError("the peer's θ_global does not hold every parameter of this model")
    return checked


class StateSharer:
    def __init__(self, dht: DHT, run_id: str, region: str, get_state: Callable[[], State], *,
                 ttl: float = 120.0, chunk_bytes: int = 2**19, chunk_timeout: float = 30.0,
                 dht_timeout: float = 30.0, snapshot: bool = True, copy_state: bool = True,
                 schema: Schema, members_only: bool = False,
                 on_reject: Callable[[PeerID, str], None] | None = None):
        """Serves this region's (outer_step, θ_global, momentum) to peers and publishes StateRecords in the DHT.

        ttl: lifetime of a DHT record; a background thread re-stores the last one every ttl/3, so a region that
        died disappears within ttl. copy_state=False: `get_state` already returns private copies nobody mutates.
        schema: the model's parameters, name -> (shape, dtype name); a downloaded state is checked against it
        before anything is allocated (`check_header`): a peer's numbers never size an allocation.
        members_only (a run with a secret, `auth.py`): the state is served only to peers a valid record of this
        run names; `on_reject(peer, what)` is called once per refused peer.
        """
        if ttl <= 0 or chunk_bytes <= 0:
            raise ValueError("ttl and chunk_bytes must be > 0")
        self.dht, self.run_id, self.region, self.get_state = dht, run_id, region, get_state
        self.ttl, self.chunk_bytes, self.chunk_timeout = float(ttl), int(chunk_bytes), float(chunk_timeout)
        self.dht_timeout = float(dht_timeout)  # a DHT store/get that hangs (dead DHT process) raises instead
        self.snapshot, self.copy_state = snapshot, copy_state
        self.schema = dict(schema)
        self.key = state_key(run_id)
        self.gate = MemberGate(dht, self.key, region, on_reject=on_reject) if members_only else None
        self._record: StateRecord | None = None
        self._served: _Served | None = None
        self._expiration = 0.0
        self._lock = threading.Lock()  # record + DHT stores in order: the last store always carries the newest
        self._stop = threading.Event()
        self._service = StreamService(dht, self._handler_name(region), self._serve, averaging_pb2.DownloadRequest,
                                      thread_name=f"state-{region}")
        self._run = self._service.run
        self.peer_id: PeerID = self._service.p2p.peer_id
        self._refresher = threading.Thread(target=self._refresh_periodically, name=f"state-refresh-{region}",
                                           daemon=True)
        self._refresher.start()

    # -- plumbing ------------------------------------------------------------------------------------
    def _handler_name(self, region: str) -> str:
        return f"{self.key}::{safe_name(region)}::download"

    def _store_locked(self, value) -> None:
        expiration = max(get_dht_time() + self.ttl, self._expiration + 1e-3)  # later store must win
        stored = self.dht.store(self.key, subkey=self.region, value=value, expiration_time=expiration,
                                return_future=True).result(timeout=self.dht_timeout)
        if not stored:
            logger.warning("[%s] storing the state record in the DHT failed", self.region)
        self._expiration = expiration

    def _record_value(self) -> dict:
        r = self._record
        return dict(outer_step=r.outer_step, digest=r.digest, group_size=r.group_size, phase=r.phase,
                    waited=r.waited, momentum_digest=r.momentum_digest, peer_id=self.peer_id.to_base58())

    def _refresh_periodically(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                with self._lock:
                    if self._record is not None and not self._stop.is_set():
                        self._store_locked(self._record_value())
            except Exception as e:  # the DHT may be shutting down
                logger.debug("[%s] refreshing the state record failed: %r", self.region, e)

    # -- publishing ----------------------------------------------------------------------------------
    def publish(self, record: StateRecord, state: State | None = None, verify: bool = True) -> None:
        """Store `record` in the DHT (subkey = region, expires after ttl unless refreshed). snapshot mode: serve
        `state` (default: get_state(), called here) from now on; verify: its step and digest must match."""
        if self._stop.is_set():
            raise RuntimeError(f"[{self.region}] the state sharer is shut down")
        if record.region != self.region:
            raise ValueError(f"record of region {record.region!r} published by {self.region!r}")
        served = None
        if self.snapshot:
            state = state if state is not None else self.get_state()
            served = _freeze(state, self.copy_state, digest=None if verify else record.digest)
            if verify and (served.outer_step, served.digest) != (record.outer_step, record.digest):
                raise ValueError(f"[{self.region}] the state is at step {served.outer_step} with digest "
                                 f"{served.digest}, but the record says {record.outer_step} / {record.digest}")
        with self._lock:
            self._record = record
            if served is not None:
                self._served = served
            self._store_locked(self._record_value())

    def set_phase(self, phase: str, waited: float = 0.0) -> None:
        """Store our record again with another phase (ready to average, having waited `waited` seconds; sitting
        out; finished): the served state stays."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {PHASES}")
        with self._lock:
            if self._record is None:
                raise RuntimeError(f"[{self.region}] nothing published yet")
            self._record = dataclasses.replace(self._record, phase=phase, waited=waited)
            self._store_locked(self._record_value())

    def _holders(self) -> list[tuple[StateRecord, PeerID]]:
        found = self.dht.get(self.key, latest=True, return_future=True).result(timeout=self.dht_timeout)
        holders = []
        if found is None or not isinstance(found.value, dict):
            return holders
        for region, item in found.value.items():
            value = getattr(item, "value", None)
            if not isinstance(value, dict):  # a tombstone (None): the region withdrew its record
                continue
            try:
                holders.append((parse_record(region, value), PeerID.from_base58(value["peer_id"])))
            except (TypeError, KeyError, ValueError):  # a malformed entry
                continue
        return sorted(holders, key=lambda h: h[0].region)

    def records(self) -> list[StateRecord]:
        """All current records of this run (including our own), sorted by region."""
        return [record for record, _ in self._holders()]

    # -- serving -------------------------------------------------------------------------------------
    async def _serve(self, request: averaging_pb2.DownloadRequest, context: P2PContext):
        if self.gate is not None and not await self.gate.admits(context.remote_id, "a state download"):
            return  # the client sees a stream without a header, as from a region with nothing to serve
        if self.snapshot:
            served = self._served
        else:
            served = await asyncio.get_running_loop().run_in_executor(
                None, lambda: _freeze(self.get_state(), copy=False))
        if served is None:
            return  # nothing published yet: the client sees a stream without a header
        header = dict(region=self.region, outer_step=served.outer_step, digest=served.digest,
                      tensors=[[kind, name, str(t.dtype).removeprefix("torch."), list(t.shape)]
                               for kind, name, t in served.tensors])
        yield averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(header))
        for _, _, tensor in served.tensors:
            raw = tensor.reshape(-1).view(torch.uint8).numpy()
            for offset in range(0, raw.size, self.chunk_bytes):
                chunk = raw[offset:offset + self.chunk_bytes].tobytes()
                yield averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=chunk))

    # -- loading -------------------------------------------------------------------------------------
    async def _download(self, peer: PeerID, region: str, want: StateRecord) -> State:
        stream = await self._service.p2p.iterate_protobuf_handler(
            peer, self._handler_name(region), averaging_pb2.DownloadRequest(), averaging_pb2.DownloadData)
        messages = aiter_with_timeout(stream, self.chunk_timeout)
        try:
            first = await anext(messages, None)
            if first is None or not first.metadata:
                raise RuntimeError("the peer serves no state")
            header = MSGPackSerializer.loads(first.metadata)
            if not isinstance(header, dict) or (header.get("outer_step"), header.get("digest")) != (
                    want.outer_step, want.digest):
                raise RuntimeError("the peer serves another state than its record names")
            theta, momentum = {}, {}
            for kind, name, shape, dtype in check_header(header, self.schema):  # before any allocation
                tensor = torch.empty(shape, dtype=dtype)
                raw = tensor.reshape(-1).view(torch.uint8).numpy()  # writes land in `tensor`
                offset = 0
                while offset < raw.size:
                    message = await anext(messages, None)
                    if message is None:
                        raise RuntimeError("the stream ended early")
                    chunk = message.tensor_part.buffer
                    if offset + len(chunk) > raw.size:
                        raise RuntimeError("the peer sent more bytes than announced")
                    raw[offset:offset + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
                    offset += len(chunk)
                (theta if kind == "theta" else momentum)[name] = tensor
            return int(header["outer_step"]), theta, momentum
        finally:
            await messages.aclose()
            await stream.aclose()

    def load_from_peers(self, want: StateRecord | None = None, timeout: float = 60.0,
                        total: float | None = None) -> State | None:
        """(outer_step, θ_global, momentum) from a peer whose record matches `want` (its region first, then other
        regions with the same step and digests), or the canonical state if want is None. The received θ_global
        must have want.digest, and its momentum want.momentum_digest (where the record names one); on any failure, mismatch or `timeout` (per holder: a slow or dying holder costs one
        download) the next holder is tried, while less than `total` seconds (default: no limit) have passed.
        None if nobody delivered."""
        started = time.monotonic()
        if self._stop.is_set():
            raise RuntimeError(f"[{self.region}] the state sharer is shut down")
        try:
            holders = self._holders()
        except Exception as e:  # the DHT did not answer
            logger.warning("[%s] reading the state records failed: %r", self.region, e)
            return None
        if want is None:
            want = choose_canonical([record for record, _ in holders])
            if want is None:
                return None
        candidates = sorted(((r, p) for r, p in holders
                             if (r.outer_step, r.digest) == (want.outer_step, want.digest)
                             # one naming another momentum would fail the download's check
                             and not (want.momentum_digest and r.momentum_digest not in ("", want.momentum_digest))
                             and r.region != self.region and p != self.peer_id),
                            key=lambda h: (h[0].region != want.region, h[0].region))
        for record, peer in candidates:
            if total is not None and time.monotonic() - started >= total:
                break
            start = time.monotonic()
            try:
                state = self._run(self._download(peer, record.region, want), timeout=timeout)
            except Exception as e:
                logger.warning("[%s] loading the state from %s failed: %r", self.region, record.region, e)
                continue
            digest = state_digest(state[1])
            if digest != want.digest:
                logger.warning("[%s] %s sent θ with digest %s, not %s", self.region, record.region, digest,
                               want.digest)
                continue
            if want.momentum_digest and state_digest(state[2]) != want.momentum_digest:
                logger.warning("[%s] %s sent a momentum that does not match the record's digest", self.region,
                               record.region)
                continue
            logger.info("[%s] loaded outer step %d (%s) from %s in %.2fs", self.region, state[0], digest,
                        record.region, time.monotonic() - start)
            return state
        return None

    def shutdown(self) -> None:
        """Withdraw our record (a tombstone that outlives it), stop serving, stop the threads."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            with self._lock:
                if self._record is not None and self.dht.is_alive():
                    self._store_locked(None)
        except Exception as e:
            logger.debug("[%s] withdrawing the state record failed: %r", self.region, e)
        self._service.shutdown(f"[{self.region}] the state sharer")
        self._refresher.join(5.0)
