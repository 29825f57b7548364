"""Cross-region averaging of pseudo-gradients over Hivemind: no master, bit-identical result on every peer.

One `RegionAverager` per region (held by the region's SyncActor). It owns a hivemind DHT node (`.dht`,
reusable by other hivemind features) and, for each round, runs one all-reduce of Δ weighted by tokens:

* Wire: any codec of `ray_diloco.sync.codecs` ('fp16' clamped to ±65504, 'scaled-fp16' with a power-of-two
  scale per part, 'bf16' as 2-byte buffers hivemind's NoCompression decodes, 'none' fp32); accumulation is
  fp32. A Δ with NaN/inf is refused before the round: nothing non-finite goes on the wire. See
  `ray_diloco.sync.hivemind_exact` for why every peer of the group ends with the same bytes (reducers answer
  with the encoded absolute average, not a per-peer delta).
* Round isolation: each round gets its own `ExactAverager` whose matchmaking prefix is
  ``diloco_<safe_name(run id)>_r<round>``: two runs on one DHT never mix and a late region never
  averages with another round (it finds nobody and goes on alone). The averager (a forked child
  process) is shut down after its round, and the next round's is started right then, in a thread, with
  shared buffers of the same shapes: its start-up (0.34 s of a 1.4 s round of 100 MB on loopback, measured
  by benchmarks/allreduce.py) leaves the critical path, at the cost of one more copy of Δ's size in memory.
  A round that is not the one prepared (a re-sync skipped rounds, a smaller group) starts its own. A fresh
  averager per round starts from clean matchmaking state and a crash of one round cannot leak into the next.
* Timeout: the group targets `expected_regions`; the leader starts as soon as it is full, otherwise
  after `matchmaking_seconds` with the regions present. A region that found nobody gives up at
  `matchmaking_seconds` + 1 s and goes on alone: its "average" is its own Δ through the codec, as the
  single-region path computes it. `average()` never takes longer than `averaging_timeout` plus the
  averager's shutdown (≤ 4 s, normally < 0.1 s), and returns at once if its averager process dies.
* ``consistent=True`` means every region in `peer_regions` holds these exact bytes. A region that
  dropped mid-round breaks that: as a reducer its parts keep each peer's local value, as a sender the
  later parts are averaged without it; both give ``consistent=False`` (never a silent mix). A failed
  all-reduce returns the own Δ through the codec with ``consistent=False`` and `error` set.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import math
import multiprocessing as mp
import re
import threading
import time
from dataclasses import dataclass, field

import torch
from hivemind import DHT

from ray_diloco.methods.settings import AGGREGATIONS
from ray_diloco.sync.auth import RecordAuthenticator, member_keys, members_named
from ray_diloco.sync.codecs import CODEC_NAMES, count_nonfinite, get_codec
from ray_diloco.sync.hivemind_exact import ExactAverager
from ray_diloco.sync.wire_codecs import make_wire_codec
from ray_diloco.sync.outer import state_digest
from ray_diloco.sync.parent_bound import ParentBoundDHT

logger = logging.getLogger(__name__)
PREPARE_WAIT_SECONDS = 10.0  # a round waits this long for the prepared averager's start, then starts its own


@dataclass
class RoundResult:
    averaged: dict[str, torch.Tensor]  # fp32, same keys/shapes as input, identical bytes on every peer of the group
    group_size: int  # regions that took part (1 = alone)
    peer_regions: list[str]  # region names in the group, sorted
    bytes_sent: int  # AveragingData messages this peer sent in the all-reduce (tensor payload + protobuf framing)
    bytes_received: int
    seconds: float  # wall time of the whole average() call
    consistent: bool  # False if a region dropped mid-round (reducer or sender) or the all-reduce failed
    error: str | None = None  # why the round failed (then `averaged` is the own Δ through the codec)
    timings: dict[str, float] = field(default_factory=dict)  # startup, step (= matchmaking + allreduce), shutdown
    # (peer id base58, its gathered metadata) of every member of the group, as the leader handed them to all of
    # them (the same list on every member); empty for a round alone. A peer's metadata is unchecked.
    members: list[tuple[str, dict]] = field(default_factory=list)
    payload_bytes: int = 0  # a compressed method's round: the size of this region's payload (methods/)
    # A compressed method's round: the region's compressor state after it, stored when its outer step applies.
    method_state: dict[str, torch.Tensor] | None = None
    # outer.aggregation 'clipped': region -> the smallest scale its contribution got (only those clipped); in a
    # dense round, from the parts this region reduced.
    clipped: dict[str, float] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """ray_diloco.sync.outer.state_digest of `averaged`: computed when asked (0.16 s for 100 MB, which every
        round paid on its critical path while only tests read it; the SyncActor digests θ_global anyway)."""
        return state_digest(self.averaged)


class _DropMessage(logging.Filter):
    """Silence hivemind logs that are expected here (we log these cases ourselves, once)."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


# A warning for every averager whose target_group_size is not a power of 2, i.e. each round with 3 regions.
logging.getLogger("hivemind.averaging.key_manager").addFilter(_DropMessage("power of 2"))
# An ERROR with a traceback when a region finds nobody: for us that is the "alone" round.
logging.getLogger("hivemind.averaging.averager").addFilter(_DropMessage("could not find a group"))


def safe_name(text: str) -> str:
    """For DHT keys and p2p handler names: no '.' or odd characters, and distinct inputs stay distinct
    (a hash tag of the original follows the sanitised text)."""
    tag = hashlib.blake2b(text.encode(), digest_size=4).hexdigest()
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', text)[:40]}_{tag}"


REPORTED_REJECTIONS = 64  # refused joins a round's averager hands back (~100 bytes each: far below a pipe's buffer)


def round_prefix(run_id: str, round_index: int) -> str:
    """Matchmaking prefix of one round of a run."""
    return f"diloco_{safe_name(run_id)}_r{int(round_index)}"


def own_result(compression: str, region: str, tensors: dict[str, torch.Tensor], *, seconds: float = 0.0,
               consistent: bool = True, error: str | None = None, timings: dict | None = None) -> RoundResult:
    """A round without the others: the region's own Δ through the codec, one scale per tensor for
    scaled-fp16 (the single-region path, a region that found nobody, and a failed round all use this)."""
    codec = get_codec(compression)
    averaged = {name: codec.roundtrip(t.detach().to("cpu", torch.float32)).reshape(t.shape)
                for name, t in tensors.items()}
    return RoundResult(averaged, 1, [region], 0, 0, seconds, consistent, error,
                       timings or {})


def _listen_maddr(host: str, port: int = 0) -> str:
    return f"/ip6/{host}/tcp/{port}" if ":" in host else f"/ip4/{host}/tcp/{port}"


def _await_step(control, averager: ExactAverager, deadline: float):
    """The step's result, but never past `deadline`, and at once if the averager process died."""
    while not control.done():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("averaging_timeout exceeded")
        try:
            return control.result(timeout=min(0.5, remaining))
        except (TimeoutError, concurrent.futures.TimeoutError):  # distinct classes before Python 3.11
            if control.done():  # the step itself failed with a timeout
                raise
        if not averager.is_alive():
            time.sleep(0.2)  # a result sent just before the exit may still be on its way
            if not control.done():
                raise RuntimeError("the averager process died mid-round")
    return control.result()


class _NoGroup(Exception):
    """No group formed for the round: the region goes on alone, and nobody averaged anything of ours."""


class _FailedMidRound(Exception):
    """The all-reduce began and broke: parts may have been averaged without us (an inconsistent round)."""

    def __init__(self, error: str):
        super().__init__(error)
        self.error = error


async def _count_peers(dht, node) -> int:
    """Runs in the DHT's process (module level: `run_coroutine` pickles it there)."""
    return len(await node.p2p.list_peers())


class RegionAverager:
    def __init__(self, *, run_id: str, region: str, expected_regions: int, compression: str = "fp16",
                 initial_peers: list[str] | None = None, host: str = "127.0.0.1",
                 matchmaking_seconds: float = 5.0, averaging_timeout: float = 60.0,
                 announce_maddrs: list[str] | None = None, dht: DHT | None = None, port: int = 0,
                 part_size_bytes: int = 2**19, next_chunk_timeout: float | None = None,
                 secret: bytes | None = None, members_key: str | None = None, max_weight: float = math.inf,
                 aggregation: str = "mean", clip_factor: float = 2.0):
        """secret: the run's secret (`auth.py`): our DHT signs and checks every record with it. members_key
        (with a secret): the DHT key whose valid records name the run's peers; only they may join our groups.
        max_weight: the largest weight a peer may declare (`ExperimentConfig.max_round_tokens`); a sender
        beyond it is left out of the parts we reduce. aggregation 'clipped': the parts we reduce are clipped to
        clip_factor × their median norm first (ray_diloco.sync.aggregation)."""
        if compression not in CODEC_NAMES:
            raise ValueError(f"compression {compression!r} is unknown; choose one of {CODEC_NAMES}")
        if expected_regions < 1:
            raise ValueError(f"expected_regions must be >= 1, got {expected_regions}")
        if matchmaking_seconds <= 0:
            raise ValueError(f"matchmaking_seconds must be > 0, got {matchmaking_seconds}")
        if averaging_timeout <= matchmaking_seconds:
            raise ValueError("averaging_timeout must exceed matchmaking_seconds (the all-reduce needs time too)")
        self.run_id, self.region, self.expected_regions = run_id, region, expected_regions
        self.compression, self.codec = compression, make_wire_codec(compression)
        self.matchmaking_seconds, self.averaging_timeout = float(matchmaking_seconds), float(averaging_timeout)
        # Hivemind: request_timeout must stay below min_matchmaking_time, or matchmaking may deadlock.
        self.request_timeout = min(3.0, 0.5 * self.matchmaking_seconds)
        self.part_size_bytes = part_size_bytes
        self.max_weight = float(max_weight)
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation {aggregation!r} is not one of {AGGREGATIONS}")
        self.clip_factor = float(clip_factor) if aggregation == "clipped" else None
        # None: a stalled peer holds the round until averaging_timeout (then every peer reports it
        # inconsistent). A value bans a sender / drops a reducer after that many seconds without a chunk;
        # the round still ends inconsistent, only sooner, at the risk of false alarms on a slow WAN (a
        # sender's end of stream counts as a chunk and comes only once it has read every reply: keep the
        # value above a round's reply time). The SyncActor leaves it None.
        self.next_chunk_timeout = next_chunk_timeout
        if members_key and not secret:
            raise ValueError("members_key without a secret: anyone could write the records that name members")
        self.members_key = members_key
        # Joins refused by a round's averager (a forked child): (peer, what) through a pipe, read by take_rejections.
        self._rejections = mp.get_context("fork").SimpleQueue() if members_key else None
        self._reported = 0  # refusals put on it; counted in each round's child (a forked copy starts at 0)
        self._members: set = set()  # the run's members known so far: each round's averager starts with them
        self._lock = threading.Lock()
        # The next round's averager, started after a round (tuple of key, averager, buffers), and its thread.
        self._prepared: tuple | None = None
        self._preparing: threading.Thread | None = None
        self._closed = False  # shut down: nothing more is prepared
        self._next_key: tuple | None = None  # the key of the round after the last one (prepare_next_round)
        self._prepared_lock = threading.Lock()  # _prepared: set by the preparing thread, taken by rounds
        self._owns_dht = dht is None
        if dht is None:
            kwargs = dict(announce_maddrs=announce_maddrs) if announce_maddrs else {}
            if secret:
                kwargs["record_validators"] = [RecordAuthenticator(secret, run_id)]
            dht = ParentBoundDHT(initial_peers=initial_peers or None, host_maddrs=[_listen_maddr(host, port)],
                                 start=True, **kwargs)
        self.dht = dht

    def _report_rejection(self, peer, what: str) -> None:  # in the round's averager process
        # Bounded: the parent reads the pipe only after the round, and a full pipe would block the child's loop
        # (peer IDs cost an outsider nothing to make). MemberGate reports each peer once per round's averager.
        self._reported += 1
        if self._reported <= REPORTED_REJECTIONS:
            self._rejections.put((peer.to_base58(), what))

    def _known_members(self, timeout: float) -> set:
        """The run's members: those known already and those the signed records name now (a lookup bounded by
        `timeout`; on failure, those known)."""
        try:
            for key in member_keys(self.members_key):
                self._members |= members_named(self.dht.get(key, latest=True, return_future=True).result(timeout))
        except Exception as error:  # noqa: BLE001 — the round's gate reads them again when asked
            logger.info("[%s] reading the run's members failed: %r", self.region, error)
        return set(self._members)

    def take_rejections(self) -> list[tuple[str, str]]:
        """(peer, what) of every join refused since the last call, by any round's averager (members-only runs)."""
        taken = []
        while self._rejections is not None and not self._rejections.empty():
            taken.append(self._rejections.get())
        return taken

    def visible_multiaddrs(self) -> list[str]:
        return [str(maddr) for maddr in self.dht.get_visible_maddrs()]

    def connected_peers(self, timeout: float = 5.0) -> int | None:
        """How many peers this node's p2p daemon is connected to now (None if the DHT did not answer in time)."""
        try:
            return int(self.dht.run_coroutine(_count_peers, return_future=True).result(timeout))
        except Exception:  # noqa: BLE001 — a metric: never worth failing a round for
            return None

    def _own_result(self, tensors, start, **kwargs) -> RoundResult:
        return own_result(self.compression, self.region, tensors, seconds=time.monotonic() - start, **kwargs)

    def average(self, tensors: dict[str, torch.Tensor], weight: float, round_index: int,
                expected_regions: int | None = None, checked_finite: bool = False,
                gather: dict | None = None, prepare_next: bool = True) -> RoundResult:
        """Weighted average of `tensors` with the regions that call this for the same run and round.
        `expected_regions`: the group this round waits for (default: the one given at construction);
        `checked_finite`: the caller already counted non-finite values (the check is a pass over the model);
        `gather`: more metadata handed to every member with the group (RoundResult.members); `prepare_next`: False
        leaves starting the next round's averager to the caller (`prepare_next_round`)."""
        start = time.monotonic()
        deadline = start + self.averaging_timeout
        expected = expected_regions or self.expected_regions
        if not tensors:
            raise ValueError("nothing to average")
        if not weight > 0:
            raise ValueError(f"weight must be > 0 (tokens trained), got {weight}")
        bad = 0 if checked_finite else sum(count_nonfinite(t) for t in tensors.values())
        if bad:  # refused here, before any peer counts on us (the codec would only fail mid-round)
            raise ValueError(f"[{self.region}] round {round_index}: Δ has {bad} non-finite value(s)")
        names = list(tensors)
        flat = [tensors[n].detach().to("cpu", torch.float32) for n in names]
        if expected == 1:
            return self._own_result(tensors, start)

        with self._lock:
            timings: dict[str, float] = {}
            key = (round_index, expected, tuple((n, tuple(t.shape)) for n, t in zip(names, flat)))
            try:
                outcome, buffers = self._step(key, flat, weight, round_index, deadline, start, timings, gather,
                                              prepare_next)
            except _NoGroup:  # nothing of ours went into anybody's average: consistent, alone
                return self._own_result(tensors, start, timings=timings)
            except _FailedMidRound as failed:
                return self._own_result(tensors, start, error=failed.error, consistent=False, timings=timings)
        return self._result(outcome, names, tensors, buffers, round_index, start, timings)

    def _step(self, key: tuple, flat: list[torch.Tensor], weight: float, round_index: int, deadline: float,
              start: float, timings: dict, gather: dict | None = None,
              prepare_next: bool = True) -> tuple[dict, list[torch.Tensor]]:
        """One averaging step in this round's averager process; the next round's averager starts after it.
        Raises _NoGroup (no group formed) or _FailedMidRound (the all-reduce began and broke)."""
        averager = control = None
        try:
            averager, buffers = self._take_prepared(key) or self._start_averager(key, deadline)
            for buffer, t in zip(buffers, flat):  # the child shares these: it reads Δ and writes the average
                buffer.copy_(t)
            timings["startup"] = time.monotonic() - start
            # A leader starts when its group is full, else at matchmaking_seconds with those there.
            control = averager.start_step(
                gather=dict(gather or {}, region=self.region, round=int(round_index), compression=self.compression),
                weight=float(weight), timeout=self.matchmaking_seconds + 1.0,
                init_timeout=max(0.1, deadline - time.monotonic()),
            )
            t_step = time.monotonic()
            outcome = _await_step(control, averager, deadline)
            timings["step"] = time.monotonic() - t_step
            return outcome, buffers
        except Exception as e:  # any failure ends the round with the own Δ
            began_allreduce = control is not None and control.began_allreduce
            if control is not None and not control.done():
                control.cancel()
            if control is not None and not began_allreduce:
                # No group formed (hivemind: "could not find a group" at the step deadline): alone.
                level = logging.INFO if "could not find a group" in str(e) else logging.WARNING
                logger.log(level, "[%s] round %d: no group (%r); going on alone", self.region, round_index, e)
                raise _NoGroup() from e
            logger.warning("[%s] round %d: averaging failed (%r); using the own Δ", self.region, round_index, e)
            raise _FailedMidRound(repr(e)) from e
        finally:
            if averager is not None:
                t_down = time.monotonic()
                averager.shutdown()
                timings["shutdown"] = time.monotonic() - t_down
            self._next_key = (round_index + 1, *key[1:])
            if prepare_next:  # the next round's averager starts now, off the critical path of that round
                self.prepare_next_round()

    def prepare_next_round(self) -> None:
        """Start the averager of the round after the last one, in a thread. It is a forked process: a stream this
        process has open while it forks is held open by the child too (its copy of the socket), so its peer never
        sees the end of it; a caller that still serves or fetches over p2p after `average` calls this after."""
        if not self._closed and self._next_key is not None:
            self._preparing = threading.Thread(target=self._prepare, args=(self._next_key,), daemon=True)
            self._preparing.start()

    def prepare_round(self, round_index: int, shapes: dict[str, tuple[int, ...]], expected_regions: int | None = None,
                      wait_seconds: float = 0.0) -> bool:
        """Start the averager of round `round_index` now, as `prepare_next_round` does after a round: for a first
        round whose averager (a forked process, seconds to start on a loaded machine) must not start inside the
        matchmaking window. `wait_seconds`: how long to wait for it; returns whether it is ready then."""
        self._next_key = (round_index, expected_regions or self.expected_regions,
                          tuple((name, tuple(shape)) for name, shape in shapes.items()))
        self.prepare_next_round()
        if self._preparing is not None:
            self._preparing.join(timeout=wait_seconds)
        with self._prepared_lock:
            return self._prepared is not None and self._prepared[0] == self._next_key

    def _result(self, outcome: dict, names: list[str], tensors: dict[str, torch.Tensor],
                buffers: list[torch.Tensor], round_index: int, start: float, timings: dict) -> RoundResult:
        """The round's result from the averager's outcome; inconsistent where a reducer or a sender dropped."""
        stats = outcome["stats"] or {}
        if "allreduce_seconds" in stats:  # the transfer and decode; the rest of the step is matchmaking
            timings["allreduce"] = float(stats["allreduce_seconds"])
        gathered = [data for _, data in outcome["gathered"]]
        averaged = {name: buf.clone().reshape(tensors[name].shape) for name, buf in zip(names, buffers)}
        problems = []
        if stats.get("failed_size", 1):  # a reducer dropped: its parts kept our local values
            problems.append(f"a reducer failed: {stats.get('failed_size')} of {stats.get('total_size')} "
                            f"values were not averaged")
        if stats.get("banned_senders", 1):  # a sender dropped: later parts were averaged without it
            problems.append(f"{stats.get('banned_senders')} sender(s) dropped mid-round: some parts were "
                            f"averaged without them")
        consistent, error = not problems, "; ".join(problems) or None
        region_of = {str(peer): str(data.get("region")) for peer, data in outcome["gathered"]}
        if error:
            logger.warning("[%s] round %d: %s", self.region, round_index, error)
        return RoundResult(
            averaged=averaged,
            group_size=len(gathered),
            peer_regions=sorted(str(data.get("region")) for data in gathered),
            bytes_sent=int(stats.get("bytes_sent", 0)),
            bytes_received=int(stats.get("bytes_received", 0)),
            seconds=time.monotonic() - start,
            consistent=consistent,
            error=error,
            timings=timings,
            members=[(str(peer), data) for peer, data in outcome["gathered"]],
            clipped={region_of.get(peer, peer): float(scale) for peer, scale in stats.get("clipped", {}).items()},
        )

    def _start_averager(self, key: tuple, deadline: float) -> tuple[ExactAverager, list[torch.Tensor]]:
        """An averager (a forked child process) for one round: its own matchmaking prefix, its own group size,
        shared-memory buffers of the round's tensor shapes."""
        round_index, expected, layout = key
        buffers = [torch.empty(shape, dtype=torch.float32).share_memory_() for _, shape in layout]
        averager = ExactAverager(
            buffers, self.dht, tensor_names=[name for name, _ in layout], prefix=round_prefix(self.run_id, round_index),
            # min_group_size=1 would make hivemind assemble a group of one at once; with 2, a
            # region that finds nobody fails matchmaking at the step deadline: handled as alone.
            target_group_size=expected, min_group_size=2,
            min_matchmaking_time=self.matchmaking_seconds, request_timeout=self.request_timeout,
            compression=self.codec, part_size_bytes=self.part_size_bytes,
            allreduce_timeout=self.averaging_timeout, next_chunk_timeout=self.next_chunk_timeout,
            # A sender reads our last replies behind the link's backlog: shutting down first would cut it off;
            # a quarter of the round's time, so that the wait itself leaves the round inside averaging_timeout.
            allow_state_sharing=False, served_timeout=0.25 * self.averaging_timeout, members_key=self.members_key,
            max_weight=self.max_weight, clip_factor=self.clip_factor,
            on_reject=self._report_rejection if self._rejections is not None else None,
            members=self._known_members(self.request_timeout) if self.members_key else (),
            shutdown_timeout=2.0,
        )
        try:
            averager.run_in_background(await_ready=True, timeout=max(0.1, deadline - time.monotonic()))
        except BaseException:
            averager.shutdown()
            raise
        return averager, buffers

    def _prepare(self, key: tuple) -> None:
        """Start the averager of the round expected next (`key`); `average` takes it if that round comes."""
        try:
            prepared = (key, *self._start_averager(key, time.monotonic() + self.averaging_timeout))
        except Exception as error:  # noqa: BLE001 — that round starts its own, as without preparation
            logger.info("[%s] preparing the averager of round %d failed: %r", self.region, key[0], error)
            return
        with self._prepared_lock:
            if self._closed:  # shut down meanwhile
                stale = prepared
            else:  # the newest wins; an older one (its round came before it was ready) goes
                stale, self._prepared = self._prepared, prepared
        if stale is not None:
            stale[1].shutdown()

    def _take_prepared(self, key: tuple) -> tuple[ExactAverager, list[torch.Tensor]] | None:
        """The prepared averager if it is for this round (index, group size, tensors); else None, the other
        one shut down (a re-synced region skips rounds; a smaller group needs another target size)."""
        if self._preparing is not None:  # normally done long ago (the inner steps ran meanwhile)
            self._preparing.join(timeout=PREPARE_WAIT_SECONDS)
            self._preparing = None
        with self._prepared_lock:
            prepared, self._prepared = self._prepared, None
        if prepared is None:
            return None
        if prepared[0] == key and prepared[1].is_alive():
            return prepared[1], prepared[2]
        prepared[1].shutdown()
        return None

    def shutdown(self) -> None:
        self._closed = True  # a round still running prepares nothing after it
        with self._lock:
            if self._preparing is not None:  # bounded: one that is still starting sees _closed and stops its averager
                self._preparing.join(timeout=PREPARE_WAIT_SECONDS)
                if self._preparing.is_alive():
                    logger.warning("[%s] the next round's averager was still starting at shutdown; it stops itself",
                                   self.region)
            with self._prepared_lock:
                prepared, self._prepared = self._prepared, None
            if prepared is not None:
                prepared[1].shutdown()
            if self._owns_dht and self.dht is not None:
                self.dht.shutdown()
            self.dht = None
