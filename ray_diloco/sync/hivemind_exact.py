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
(`_call_reducer`, `wait_until_served`, in `ray_diloco.sync.exact_allreduce`; stock hivemind loses the last
replies to a slow reader),
`run_in_background` does not call signal.signal() in the parent, `start_step` cannot block forever on a
dead child, and `_shutdown` does not trip over stock's `Future.finalize` bug.

Hivemind internals this project relies on (private or undocumented in hivemind 1.1.x, hence the
`hivemind>=1.1.10,<1.2` bound; re-check each one before moving the bound). Everything else we use is public
API (DHT, DHT.store/get/run_coroutine, P2P.replicate, add_protobuf_handler, iterate_protobuf_handler,
call_binary_stream_handler, P2P.send_protobuf/receive_protobuf/END_OF_STREAM, CompressionBase,
MSGPackSerializer, get_dht_time):

* `ray_diloco.sync.exact_allreduce`, `ExactAllReduceRunner(AllReduceRunner)`: overrides `_communicate_with_peer`,
  `_generate_input_for_peer`, `_accumulate_parts_streaming`, `rpc_aggregate_part`; calls `_ban_sender`,
  `should_delay_results`, `_servicer_type._get_handle_name`; reads `_p2p`,
  `_prefix`, `modes`, `ordered_peer_ids`, `sender_peer_ids`, `peer_id`, `weight`, `reducer_timeout`,
  `banned_senders`, `parts_for_local_averaging`, `tensor_part_reducer` (`accumulate_part`, `num_parts`,
  `part_shapes`) and
  `tensor_part_container` (`compression`, `prefetch`, `num_parts_by_peer`, `register_processed_part`,
  `register_failed_reducer`, `failed_size`, `total_size`, and sets `return_deltas`); `AveragingMode`;
  `AllreduceException`, `BannedException` (hivemind.averaging.partition); the AveragingData protobuf
  (hivemind.proto.averaging_pb2); hivemind.utils.asyncio's `amap_in_executor`; the p2p stream protocol (a
  request stream ends with END_OF_STREAM; a handler reads until then).
* this module, `ExactAverager(DecentralizedAverager)`: overrides `_aggregate_with_group`,
  `_run_allreduce_inplace_`, `_shutdown`, `run`, `run_in_background`; uses `schema_hash`, `_p2p`, `prefix`,
  `_running_groups` (filled by `_register_allreduce_group`), `matchmaking_kwargs`, `serializer`, `bandwidth`,
  `mode`, `shutdown_timeout`, `remove_p2p_handlers`, the pipe protocol `_outer_pipe.send(("_step", ...,
  dict(step=, future_for_init=)))` and `_inner_pipe.send(("_SHUTDOWN", None))` (ends
  `_background_thread_fetch_current_state`); `StepControl(...)`, `.attach`, `.allow_allreduce`,
  `.began_allreduce`, `GroupInfo`, `MPFuture`; the runner's `finalize(cancel=True)`; `NoCompression`'s
  2-byte "bfloat16" buffer format and `deserialize_torch_tensor`.
* `ray_diloco.sync.clipped_reducer`: `TensorPartReducer` (subclassed; its own docstring lists what it uses), and
  `ExactAllReduceRunner` replaces its `tensor_part_reducer` right after `AllReduceRunner.__init__` creates it.
* `ray_diloco.sync.averaging`: the log texts "power of 2" (logger hivemind.averaging.key_manager) and "could not
  find a group" (hivemind.averaging.averager), which it filters and matches on.
* `ray_diloco.sync.state_sharing`: `DHT._get_p2p_daemon_listen_maddr` (to replicate the DHT's p2p daemon) and
  the DownloadRequest/DownloadData protobufs of hivemind.proto.averaging_pb2 (reused for our own stream).
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import math
import os
import signal
import time
from typing import AsyncIterator, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time, get_logger

from ray_diloco.sync.auth import MemberGate
from ray_diloco.sync.exact_allreduce import ExactAllReduceRunner
from ray_diloco.sync.parent_bound import HIVEMIND_SOCKETS, exit_with_parent, remove_files, socket_files

logger = get_logger(__name__)


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
