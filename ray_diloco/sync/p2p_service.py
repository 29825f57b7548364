"""A libp2p stream handler of our own on the DHT's p2p daemon, served from an asyncio thread of its own.

StateSharer (θ_global + momentum downloads) and PayloadExchange (a compressed round's all-gather) each serve one
streaming protobuf handler and call other regions' handlers. Both need the same plumbing, here:
- an asyncio loop in a daemon thread, so serving never waits for the caller's thread (a Ray actor method);
- our own `P2P.replicate` client of the DHT's daemon, bound to that loop (`dht.replicate_p2p()` caches one
  replica per process on the DHT object: it would be tied to this loop for every other user in the process);
- `run(coro, timeout)` from any thread, and a `shutdown` that removes the handler before the client stops.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from hivemind import DHT
from hivemind.p2p import P2P

logger = logging.getLogger(__name__)


class StreamService:
    def __init__(self, dht: DHT, handler_name: str, handler: Callable, request_type: type, thread_name: str):
        """Serve `handler` (an async generator of protobuf messages, taking a `request_type` and a P2PContext)
        as `handler_name` on the DHT's p2p daemon."""
        self.handler_name = handler_name
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=thread_name, daemon=True)
        self._thread.start()
        daemon_maddr = dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr)
        self.p2p: P2P = self.run(self._start(daemon_maddr, handler, request_type), timeout=60.0)

    async def _start(self, daemon_maddr, handler: Callable, request_type: type) -> P2P:
        p2p = await P2P.replicate(daemon_maddr)
        await p2p.add_protobuf_handler(self.handler_name, handler, request_type, stream_output=True)
        return p2p

    def run(self, coro, timeout: float):
        """Run `coro` on the service's loop, from any other thread; TimeoutError after `timeout` seconds."""
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop)
        return future.result(timeout + 5.0)

    def shutdown(self, what: str) -> None:
        """Stop serving and stop the client and the thread; `what` names the service in a debug line if the
        daemon is gone already."""
        async def stop():
            try:
                await self.p2p.remove_protobuf_handler(self.handler_name, stream_output=True)
            finally:
                await self.p2p.shutdown()
        try:
            self.run(stop(), timeout=10.0)
        except Exception as error:  # noqa: BLE001 — the daemon may be gone already
            logger.debug("stopping %s failed: %r", what, error)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
