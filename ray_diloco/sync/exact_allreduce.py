"""The butterfly all-reduce of one round whose result is the same bytes on every peer of the group:
`ExactAllReduceRunner`, run by `ray_diloco.sync.hivemind_exact.ExactAverager` in its forked child.

Why absolute averaged parts instead of stock's deltas, what a failed reducer or a dropped sender leaves, and the
Hivemind internals this relies on: `ray_diloco.sync.hivemind_exact`'s docstring (one list for both modules).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from typing import AsyncIterator, Optional

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import amap_in_executor

from ray_diloco.sync.clipped_reducer import ClippedPartReducer
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
