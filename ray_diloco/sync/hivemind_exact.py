"""Hivemind all-reduce whose result is the same bytes on every peer of the group.

Stock hivemind (1.1.x) answers each sender of a part with a *delta* (averaged − that sender's part),
compressed, and each peer adds the decoded delta to its own local part. With FP16 on the wire every peer
ends with a slightly different average, so regions that apply the same outer step drift apart.

Here a reducer answers with the **absolute** averaged part, encoded once by the wire codec
(`ray_diloco.sync.wire_codecs`; same byte
count as the stock delta), and the owner of a part runs its own averaged part through the same
encode/decode. Each part's average is computed on exactly one peer (its reducer) and every peer, the
reducer included, decodes the same bytes; decoding (fp16/bf16 -> fp32, fp32 as is, scaled fp16 times a
power of two) is exact and deterministic, so all peers hold bit-identical results. The reducer also runs
its *own* contribution through the codec before accumulating it, so the average is
Σ wᵢ·decode(encode(Δᵢ)) / Σ wᵢ whichever peer reduces a part (as `ray_diloco.sync.outer.weighted_average` and
the single-region path compute it; scaled-fp16 scales per part here, per tensor there). Every wire codec
refuses NaN/inf.

A part whose reducer failed keeps the local part (`TensorPartContainer.register_failed_reducer` with
`return_deltas=False`), and a sender that dropped is left out of the parts it had not sent yet; the
runner reports `failed_size` and `banned_senders` so the caller can flag the round inconsistent.

Also fixed for one short-lived averager per round, called from any thread: a sender ends its request
stream to a reducer only once it holds every reply, and the reducer's round waits for that
(`_call_reducer`, `wait_until_served`; stock hivemind loses the last replies to a slow reader),
`run_in_background` does not call signal.signal() in the parent, `start_step` cannot block forever on a
dead child, and `_shutdown` does not trip over stock's `Future.finalize` bug.

Hivemind internals this project relies on (private or undocumented in hivemind 1.1.x, hence the
`hivemind>=1.1.10,<1.2` bound; re-check each one before moving the bound). Everything else we use is public
API (DHT, DHT.store/get/run_coroutine, P2P.replicate, add_protobuf_handler, iterate_protobuf_handler,
call_binary_stream_handler, P2P.send_protobuf/receive_protobuf/END_OF_STREAM, CompressionBase,
MSGPackSerializer, get_dht_time):

* this module, `ExactAllReduceRunner(AllReduceRunner)`: overrides `_communicate_with_peer`,
  `_generate_input_for_peer`, `_accumulate_parts_streaming`, `rpc_aggregate_part`; calls `_ban_sender`,
  `should_delay_results`, `finalize(cancel=True)`, `_servicer_type._get_handle_name`; reads `_p2p`,
  `_prefix`, `modes`, `ordered_peer_ids`, `sender_peer_ids`, `peer_id`, `weight`, `reducer_timeout`,
  `banned_senders`, `parts_for_local_averaging`, `tensor_part_reducer` (`accumulate_part`, `num_parts`,
  `part_shapes`) and
  `tensor_part_container` (`compression`, `prefetch`, `num_parts_by_peer`, `register_processed_part`,
  `register_failed_reducer`, `failed_size`, `total_size`, and sets `return_deltas`); `AveragingMode`;
  `AllreduceException`, `BannedException` (hivemind.averaging.partition); the AveragingData protobuf
  (hivemind.proto.averaging_pb2); the p2p stream protocol (a request stream ends with END_OF_STREAM; a
  handler reads until then).
* this module, `ExactAverager(DecentralizedAverager)`: overrides `_aggregate_with_group`,
  `_run_allreduce_inplace_`, `_shutdown`, `run`, `run_in_background`; uses `schema_hash`, `_p2p`, `prefix`,
  `_running_groups` (filled by `_register_allreduce_group`), `matchmaking_kwargs`, `serializer`, `bandwidth`,
  `mode`, `shutdown_timeout`, `remove_p2p_handlers`, the pipe protocol `_outer_pipe.send(("_step", ...,
  dict(step=, future_for_init=)))` and `_inner_pipe.send(("_SHUTDOWN", None))` (ends
  `_background_thread_fetch_current_state`); `StepControl(...)`, `.attach`, `.allow_allreduce`,
  `.began_allreduce`, `GroupInfo`, `MPFuture`; hivemind.utils.asyncio's `amap_in_executor`; `NoCompression`'s
  2-byte "bfloat16" buffer format and `deserialize_torch_tensor`.
* `ray_diloco.sync.clipped_reducer`: `TensorPartReducer` (subclassed; its own docstring lists what it uses), and
  this module replaces the runner's `tensor_part_reducer` right after `AllReduceRunner.__init__` creates it.
* `ray_diloco.sync.averaging`: the log texts "power of 2" (logger hivemind.averaging.key_manager) and "could not
  find a group" (hivemind.averaging.averager), which it filters and matches on.
* `ray_diloco.sync.state_sharing`: `DHT._get_p2p_daemon_listen_maddr` (to replicate the DHT's p2p daemon) and
  the DownloadRequest/DownloadData protobufs of hivemind.proto.averaging_pb2 (reused for our own stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import functools
import hashlib
import math
import os
import signal
import time
from typing import AsyncIterator, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time, get_logger
from hivemind.utils.asyncio import amap_in_executor

from ray_diloco.sync.auth import MemberGate
from ray_diloco.sync.clipped_reducer import ClippedPartReducer
from ray_diloco.sync.parent_bound import HIVEMIND_SOCKETS, exit_with_parent, remove_files, socket_files
from ray_diloco.sync.wire_codecs import check_part, decode_part, roundtrip

logger = get_logger(__name__)
CLOSE_WAIT_SECONDS = 5.0  # a sender waits this long for its reducer to close after our stream ended


def _exception_of(task: asyncio.Task) -> Optional[BaseException]:
    """A finished task's exception (retrieved), None while it runs, was cancelled or succeeded."""
    return task.exception() if task.done() and not task.cancelled() else None


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce that returns absolute averaged parts (not deltas), identical on every peer.

    Also counts the bytes of the AveragingData messages this peer sends and receives (protobuf size of
    the tensor payload plus a few bytes of framing; libp2p/noise/yamux framing is not counted).
    """

    def __init__(self, *, max_weight: float = math.inf, clip_factor: Optional[float] = None, **kwargs):
        super().__init__(**kwargs)
        self.max_weight = max_weight  # a sender's declared weight beyond it is refused (check_part)
        if clip_factor is not None:  # outer.aggregation 'clipped': our parts are clipped, then averaged
            self.tensor_part_reducer = ClippedPartReducer(self.tensor_part_reducer.part_shapes,
                                                          len(self.sender_peer_ids), clip_factor)
        assert self.modes[self.ordered_peer_ids.index(self.peer_id)] == AveragingMode.NODE, "only NODE peers"
        # A failed reducer's part then keeps the local *value* (not a zero delta); see failed_size.
        self.tensor_part_container.return_deltas = False
        self.codec: CompressionBase = self.tensor_part_container.compression
        self.bytes_sent = self.bytes_received = 0
        self._sent_shapes: dict[int, list[torch.Size]] = {}  # per reducer: the shapes of the parts we sent it
        self._served: set[PeerID] = set()  # remote senders whose rpc_aggregate_part has ended
        self._served_changed = asyncio.Event()
        # Where each exchange stands (`progress`): a round that does not end says which stream stalled.
        self._started = time.monotonic()
        self._stream_opened: dict[PeerID, float] = {}  # remote reducer -> seconds into the round its stream opened
        self._replies_in: dict[PeerID, int] = {}  # remote reducer -> replies we hold

    # -- as a sender: our parts go to each reducer, its averaged parts come back --------------------------
    async def _communicate_with_peer(self, peer_id: PeerID):
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id != self.peer_id:
            return await self._communicate_with_remote_reducer(peer_id, peer_index)
        loop = asyncio.get_event_loop()
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            # Our own contribution goes through the codec like everybody else's.
            wire_part = await loop.run_in_executor(None, roundtrip, self.codec, tensor_part)
            averaged_part = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, wire_part, weight=self.weight
            )
            # The bytes we send the other senders, decoded: what they will hold for this part.
            result = await loop.run_in_executor(None, roundtrip, self.codec, averaged_part)
            self.tensor_part_container.register_processed_part(peer_index, part_index, result)

    async def _communicate_with_remote_reducer(self, peer_id: PeerID, peer_index: int):
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        part_index = 0
        try:
            prefetch = self.tensor_part_container.prefetch
            decode = functools.partial(self._decode_reply, peer_id)
            replies = self._call_reducer(peer_id, self._generate_input_for_peer(peer_index), expected)
            # Both closed in order (amap's prefetch first, then our stream) also when a reply fails to decode.
            async with contextlib.aclosing(replies), contextlib.aclosing(
                amap_in_executor(decode, replies, max_prefetch=prefetch)
            ) as decoded:
                sent = self._sent_shapes.setdefault(peer_index, [])
                async for averaged_part, nbytes in decoded:
                    self.bytes_received += nbytes
                    expected = sent[part_index] if part_index < len(sent) else torch.Size([-1])  # unasked: refused
                    check_part(averaged_part, expected, 1.0, f"reducer {peer_id}")
                    self.tensor_part_container.register_processed_part(peer_index, part_index, averaged_part)
                    part_index += 1
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug(f"Caught {e!r} when communicating to {peer_id} ({part_index} of {expected} parts in)",
                             exc_info=True)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _call_reducer(self, peer_id: PeerID, requests: AsyncIterator[averaging_pb2.AveragingData],
                            expected: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """The reducer's `expected` replies to our parts: hivemind's stub call of rpc_aggregate_part, except that
        our request stream ends only once every reply is in, and we close only after the reducer has.

        With the stub, a reducer's handler ended once it had written its last reply; its p2p daemon then closes
        the stream, which (by the daemon's pipe code) resets it, and a reset drops what the reader's daemon
        still buffers: our last replies, behind a slow link or on a busy host (50 Mbit/s WAN run: 1 round in
        15; test_slow_region under CI load). Ending late also keeps the reducer's round (its averager process)
        alive until we hold everything (its `wait_until_served`). A reducer that ends early or whose process
        dies closes the stream: we fail it at once (a host or link gone silent holds us until reducer_timeout
        or the round's timeout, as in stock). A sender whose reducer delays results (hivemind: a peer with no
        share) ends its stream after the last part, as stock does, with stock's exposure to that reset."""
        handle = self._servicer_type._get_handle_name(self._prefix, "rpc_aggregate_part")
        _, reader, writer = await self._p2p.call_binary_stream_handler(peer_id, handle)
        self._stream_opened[peer_id] = time.monotonic() - self._started
        all_in = asyncio.Event()
        if self.should_delay_results(self.peer_id):  # (its reducer answers only after our stream ends)
            all_in.set()

        async def send_parts():
            try:
                async for request in requests:
                    await P2P.send_protobuf(request, writer)
                await all_in.wait()
                await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
            except BaseException:
                writer.close()  # the reducer sees our stream end (it bans us), and we see its end: nobody waits
                raise

        sending = asyncio.create_task(send_parts())
        try:
            for received in range(expected):
                try:
                    reply, error = await asyncio.wait_for(
                        P2P.receive_protobuf(averaging_pb2.AveragingData, reader), self.reducer_timeout)
                except asyncio.IncompleteReadError:
                    failed_to_send = _exception_of(sending)
                    if failed_to_send is not None and not isinstance(failed_to_send, ConnectionError):
                        raise failed_to_send  # our own parts failed (a connection error is the reducer's end)
                    raise AllreduceException(f"peer {peer_id} sent {received} parts, but we expected {expected}")
                if error is not None:
                    raise AllreduceException(f"peer {peer_id} failed: {error.message}")
                self._replies_in[peer_id] = received + 1
                yield reply
            all_in.set()
            try:  # the reducer closes once it has read our end; closing first could reset that end away
                await asyncio.wait_for(sending, CLOSE_WAIT_SECONDS)
                await asyncio.wait_for(reader.read(), CLOSE_WAIT_SECONDS)
            except asyncio.TimeoutError:
                logger.debug(f"{peer_id} did not take our end or close its stream within {CLOSE_WAIT_SECONDS} s")
        finally:
            sending.cancel()
            _exception_of(sending)  # retrieved, so asyncio does not log it again: the reason above is ours
            writer.close()

    @staticmethod
    def _decode_reply(peer_id: PeerID, msg: averaging_pb2.AveragingData) -> tuple[torch.Tensor, int]:
        """A reducer's averaged part (run in an executor thread), and its size on the wire."""
        if msg.code != averaging_pb2.AVERAGED_PART:
            raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
        return decode_part(msg.tensor_part), msg.ByteSize()

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        sent = self._sent_shapes.setdefault(peer_index, [])
        async for msg in super()._generate_input_for_peer(peer_index):
            self.bytes_sent += msg.ByteSize()
            sent.append(torch.Size(msg.tensor_part.size))  # before its reply can come: a reply answers a part
            yield msg

    # -- as a reducer: accumulate the senders' parts, answer each with the encoded average -----------------
    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        try:
            async for msg in super().rpc_aggregate_part(stream, context):
                yield msg
        finally:
            self._served.add(context.remote_id)
            self._served_changed.set()

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight, nbytes in amap_in_executor(
                lambda msg: (decode_part(msg.tensor_part), msg.weight, msg.ByteSize()),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                self.bytes_received += nbytes
                shapes = self.tensor_part_reducer.part_shapes
                expected = shapes[part_index] if part_index < len(shapes) else torch.Size([-1])  # extra: refused
                check_part(tensor_part, expected, weight, f"sender {self.sender_peer_ids[sender_index]}",
                           self.max_weight)
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    logger.debug(f"Sender {sender_index} is already banned")
                    break
                # Absolute average, encoded with *our* codec: every sender decodes these same bytes.
                info = CompressionInfo.from_tensor(averaged_part)
                serialized = await loop.run_in_executor(None, self.codec.compress, averaged_part, info)
                reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                self.bytes_sent += reply.ByteSize()
                yield reply
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    async def wait_until_served(self, timeout: float) -> bool:
        """Wait until every remote sender's rpc_aggregate_part has ended (or it was banned).

        Our outputs can be complete while a sender is still reading our last replies; a per-round averager
        that shut down then would reset the stream and cut that sender off (stock hivemind keeps its averager
        alive). A sender ends its request stream only once it holds every reply (`_call_reducer`), so a
        handler that ended normally has been acknowledged; one ended by a ban or an error does not wait.
        """
        if self.tensor_part_container.num_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)] == 0:
            return True  # nobody sends us anything
        remote = [p for p in self.sender_peer_ids if p != self.peer_id]
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            pending = [p for p in remote if p not in self._served and p not in self.banned_senders]
            if not pending:
                await asyncio.sleep(0.01)  # let p2p close the streams
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.warning(f"{self}: {len(pending)} sender stream(s) still open after all-reduce")
                return False
            self._served_changed.clear()
            try:
                await asyncio.wait_for(self._served_changed.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                pass

    def progress(self) -> str:
        """Where each exchange with another peer stands, in one line: for a round that did not end, which peer's
        stream stalled, and at what point (not open, parts not taken, replies not coming)."""
        parts_by_peer = self.tensor_part_container.num_parts_by_peer
        lines = []
        for index, peer in enumerate(self.ordered_peer_ids):
            if peer != self.peer_id and parts_by_peer[index]:
                opened = self._stream_opened.get(peer)
                lines.append(f"to reducer {peer}: " + ("stream not open" if opened is None else
                                                       f"stream open at {opened:.1f}s")
                             + f", {len(self._sent_shapes.get(index, ()))} part(s) handed to it, "
                               f"{self._replies_in.get(peer, 0)} of {parts_by_peer[index]} replies in")
        reducer = self.tensor_part_reducer
        for index, sender in enumerate(self.sender_peer_ids):
            if sender != self.peer_id:
                lines.append(f"from sender {sender}: {reducer.num_parts_received[index]} of {reducer.num_parts} "
                             f"part(s) in")
        return "; ".join(lines) or "no other peer"

    def stats(self) -> dict:
        container = self.tensor_part_container
        return dict(
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            failed_size=container.failed_size,
            total_size=container.total_size,
            banned_senders=len(self.banned_senders),
            # Senders whose parts our reducer clipped (outer.aggregation 'clipped'): peer -> smallest scale.
            clipped=({str(self.sender_peer_ids[i]): scale for i, scale in self.tensor_part_reducer.scales.items()
                      if scale < 1.0} if isinstance(self.tensor_part_reducer, ClippedPartReducer) else {}),
            peer_ids=[str(p) for p in self.ordered_peer_ids],
        )


class ExactAverager(DecentralizedAverager):
    """DecentralizedAverager that runs `ExactAllReduceRunner` and *copies* its output into the tensors.

    The averaged tensors' names join the schema hash (stock hashes shapes/dtypes only), so peers whose
    tensors differ by name never match. `step()` returns dict(gathered=[(peer_id, data) in group order],
    stats=runner stats) instead of the gathered dict: the runner lives in this forked child process and
    that is the only way its byte counts come back to the caller.
    """

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht, *, tensor_names: Sequence[str] = (),
                 served_timeout: float = 10.0, members_key: Optional[str] = None, on_reject=None, members=(),
                 max_weight: float = math.inf, clip_factor: Optional[float] = None, **kwargs):
        super().__init__(averaged_tensors, dht, start=False, **kwargs)
        # members_key (a run with a secret): only peers that a valid record under it names may join our group.
        # on_reject(peer, what) runs in the forked child: it must hand the refusal to the parent (a queue).
        self._gate = MemberGate(dht, members_key, self.prefix, on_reject=on_reject, members=members,
                                lookup_seconds=0.5 * kwargs.get("request_timeout", 3.0)) if members_key else None
        # The aggregation joins it too: a region that would clip and one that would not never share a group.
        names_hash = hashlib.blake2b("\0".join([*tensor_names, f"clip={clip_factor}"]).encode(),
                                     digest_size=16).digest()
        self.schema_hash = hashlib.blake2b(self.schema_hash + names_hash, digest_size=20).digest()
        self.served_timeout = served_timeout
        self.max_weight, self.clip_factor = max_weight, clip_factor
        self._round_stats: Optional[dict] = None  # started by the caller: run_in_background()

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        # Stock calls signal.signal() here, which raises off the main thread (a Ray actor's executor).
        self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    def run(self):
        exit_with_parent()  # a SyncActor process killed outright must not leave its round's averager running
        try:  # in the child: the forking thread is its main thread now
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:
            pass
        # Every thread's stack to stderr (the SyncActor's log) on SIGUSR1: `shutdown` asks for it before it
        # terminates a child that does not answer, so a stalled all-reduce says where it stalled.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        # No torch op here: this thread is the copy of the forking one, and where that thread had run an OpenMP
        # parallel op (any op on more than 32,768 values), the child's first such op in it hangs for good (GNU
        # OpenMP's pool does not survive a fork; seen here with torch 2.13). Stock serves in a thread of its own,
        # whose pool is new.
        super().run()

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self._gate is not None and not await self._gate.admits(context.remote_id, "a request to join the group"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        self._round_stats = None
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        return dict(
            gathered=[(str(peer_id), gathered[peer_id]) for peer_id in group_info.peer_ids],
            stats=self._round_stats,
        )

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: Optional[bytes] = None, **kwargs
    ):
        group_id = group_info.group_id if group_id is None else group_id
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            max_weight=self.max_weight,
            clip_factor=self.clip_factor,
            **kwargs,
        )
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        start = time.perf_counter()
        outputs = aiter(runner)
        try:
            for tensor in tensors:
                tensor.copy_(await anext(outputs))  # absolute average: copy, never add to the local value
            allreduce_seconds = time.perf_counter() - start
            # To its end, not stock's azip (which leaves run() finishing in the background): run() ends only once
            # our streams to the reducers have closed, and our END_OF_STREAM must be out before this process exits.
            async for _ in outputs:
                raise AllreduceException("the all-reduce returned more tensors than it was given")
        except BaseException as e:  # a failed or timed-out round says where each of its streams stood
            try:
                where = runner.progress()
            except Exception as progress_error:  # noqa: BLE001 — never in place of the round's own error
                where = f"(progress unknown: {progress_error!r})"
            logger.warning(f"All-reduce ended by {e!r} after {time.perf_counter() - start:.1f}s: {where}")
            raise
        served = await runner.wait_until_served(self.served_timeout)
        self._round_stats = dict(runner.stats(), allreduce_seconds=allreduce_seconds, all_served=served)

    def start_step(self, *, gather, weight: float, timeout: float, init_timeout: float) -> StepControl:
        """`step(wait=False, allow_retries=False)` whose hand-shake with the child cannot block forever.

        No retries: a failed all-reduce may have overwritten some tensors with averages already.
        """
        scheduled_time = get_dht_time() + self.matchmaking_kwargs["min_matchmaking_time"]
        deadline = get_dht_time() + timeout
        assert scheduled_time < deadline, "Scheduled start time does not fit within timeout"
        data_for_gather = self.serializer.dumps([self.bandwidth, self.mode.value, self.serializer.dumps(gather)])
        step = StepControl(scheduled_time=scheduled_time, deadline=deadline, allow_retries=False,
                           weight=float(weight), data_for_gather=data_for_gather)
        future_for_init = MPFuture()
        self._outer_pipe.send(("_step", [], dict(step=step, future_for_init=future_for_init)))
        step.attach(*future_for_init.result(timeout=init_timeout))
        step.allow_allreduce()
        return step

    async def _shutdown(self, timeout: Optional[float]) -> None:
        # Stock calls .finalize() on the asyncio.Future of each running group (an AttributeError);
        # finalize the runner it holds instead, which also tells its peers that we cancelled.
        try:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
            for future in self._running_groups.values():
                if not future.done():
                    future.cancel()
                elif not future.cancelled() and future.exception() is None:
                    future.result().finalize(cancel=True)
        finally:
            # Stock leaves this process's client of the DHT's p2p daemon open: the process exits, but its socket
            # file stays in /tmp, one per round and region (thousands over a run). Closing it removes the file.
            with contextlib.suppress(Exception):
                await self._p2p.shutdown()

    def shutdown(self) -> None:
        """Stop the child (terminate, then kill, if it does not exit in time) and the host-side thread."""
        if self.is_alive():
            try:
                self._outer_pipe.send(("_shutdown", [self.shutdown_timeout], {}))
            except (OSError, ValueError):
                pass
            self.join(self.shutdown_timeout)
            if self.is_alive():
                logger.warning("Averager did not shut down within the grace period; terminating it (its stacks "
                               "follow on stderr)")
                with contextlib.suppress(OSError):
                    os.kill(self.pid, signal.SIGUSR1)
                    self.join(1.0)
                # Its own socket files, which a killed child cannot remove: not those it inherited from this
                # process (our live p2p clients' listeners).
                files = socket_files([self.pid], HIVEMIND_SOCKETS) - socket_files([os.getpid()], HIVEMIND_SOCKETS)
                self.terminate()
                self.join(1.0)
                if self.is_alive():
                    self.kill()
                    self.join(1.0)
                remove_files(files)
        try:
            self._inner_pipe.send(("_SHUTDOWN", None))  # ends _background_thread_fetch_current_state
        except (OSError, ValueError):
            pass
