"""A round of a compressed outer method (sparseloco, dct): compress Δ, form the group, all-gather the payloads,
decode and sum them in the regions' order. A mixin of `SyncActorImpl`, beside `Rounds` (rounds.py), whose
rendezvous, outer step, publishing and record it shares: only what is sent and how it is combined differ.

The group is formed by the same Hivemind matchmaking as a dense round (its all-reduce carries a 256-value marker). Each
member's gathered metadata names its payload (size, digest, tokens); the leader hands every member the same
list, so every member fetches the same payloads and sums them in the same order: the same bits everywhere
(ray_diloco.sync.payloads, ray_diloco.methods.compressors). A member whose metadata is malformed is left out by
every member alike. A payload that fails to arrive (or does not match its digest) leaves this region's sum
apart from the others': the round is then marked inconsistent, as a dense round with a dropped reducer is, and
the region votes as a group of one and re-syncs by the usual rules.

The compressor's state (error feedback / momentum) is the region's own: it is saved in the region's
checkpoints and restored on resume; a region that joins or re-syncs to another region's θ_global starts it at
zero, as a fresh replica does (the papers give no rule; the buffer held what the region owed on the θ it left).
"""

from __future__ import annotations

import logging
import time

import torch

from ray_diloco.methods.compressors import Compressor
from ray_diloco.methods.settings import COMPRESSED, MethodSettings
from ray_diloco.sync.averaging import RoundResult
from ray_diloco.sync.payloads import PayloadExchange, payload_digest

logger = logging.getLogger("ray_diloco.sync.actor")
# The group's all-reduce carries a marker of this many values: hivemind gives every member a part to reduce (a
# member without one would be a client, which the exact all-reduce does not run), so a group of up to 256.
MARKER_VALUES = 256
MAX_TOKENS = 2**53  # a peer's token count beyond this is malformed (a float would no longer hold it exactly)
SERVED_WAIT_SECONDS = 10.0  # after our fetches, how long we wait for the others to have fetched ours


def _checked_members(members: list[tuple[str, dict]], size: int) -> tuple[list[tuple[str, str, int, str]], list]:
    """((peer, region, tokens, digest) sorted by region, the malformed ones): a peer's metadata must name a
    region, a payload of exactly our size (the same method and model) with a digest, and positive tokens."""
    valid, malformed, seen = [], [], set()
    for peer, data in members:
        try:
            region, tokens = data["region"], data["tokens"]
            digest, announced = data["payload_digest"], data["payload_bytes"]
            ok = (isinstance(region, str) and region not in seen and isinstance(tokens, int)
                  and 0 < tokens <= MAX_TOKENS and isinstance(digest, str) and len(digest) == 32
                  and announced == size)
        except (TypeError, KeyError):
            ok = False
        if ok:
            seen.add(region)
            valid.append((peer, region, tokens, digest))
        else:
            malformed.append(peer)
    return sorted(valid, key=lambda member: member[1]), malformed


class CompressedRounds:
    """The compressed-method side of `SyncActorImpl` (see the module docstring)."""

    def _start_compressor(self) -> None:
        cfg = self.config
        self.compressor = self.payloads = None
        if cfg.outer.method not in COMPRESSED:
            return
        self.compressor = Compressor(MethodSettings.of(cfg.outer), self.shapes)
        if self.averager is not None:
            self.payloads = PayloadExchange(self.averager.dht, cfg.run.name, self.region,
                                            chunk_timeout=cfg.outer.averaging_timeout)

    def _average_compressed(self, delta: dict[str, torch.Tensor], tokens: int, outer_step: int,
                            expected: int) -> RoundResult:
        """The round's decoded, token-weighted mean of the group's payloads (runs in an executor thread)."""
        start = time.monotonic()
        payload, _ = self.compressor.compress(delta)
        if self.payloads is None or expected == 1:
            return self._compressed_result([(tokens, payload)], [self.region], start, len(payload))
        try:
            return self._exchange_payloads(payload, tokens, outer_step, expected, start)
        except Exception as error:  # the region goes on alone this round rather than dying
            self.record_event("averaging_error", error=repr(error)[:300])
            logger.warning("[%s] round %d: the payload exchange failed (%r); using the own payload", self.region,
                           outer_step, error)
            return self._compressed_result([(tokens, payload)], [self.region], start, len(payload),
                                           consistent=False, error=repr(error))

    def _exchange_payloads(self, payload: bytes, tokens: int, outer_step: int, expected: int,
                           start: float) -> RoundResult:
        # The next round's averager (a forked process) starts only after our payloads are fetched and served: a
        # fork would hold every stream open at that moment open in the child too, and its peer would never see
        # the stream end (measured: a fetch hung until its timeout whenever the fork fell inside it).
        try:
            return self._form_and_fetch(payload, tokens, outer_step, expected, start)
        finally:
            self.averager.prepare_next_round()

    def _form_and_fetch(self, payload: bytes, tokens: int, outer_step: int, expected: int,
                        start: float) -> RoundResult:
        outer = self.config.outer
        self.payloads.offer(outer_step, payload)
        formed = self.averager.average(
            {"round": torch.ones(MARKER_VALUES)}, weight=float(tokens), round_index=outer_step,
            expected_regions=expected, checked_finite=True, prepare_next=False,
            gather={"payload_bytes": len(payload), "payload_digest": payload_digest(payload), "tokens": tokens})
        for peer, what in self.averager.take_rejections():
            self.peer_rejected(peer, what)
        members, malformed = _checked_members(formed.members, len(payload))
        for peer in malformed:
            self.peer_rejected(peer, "a round with malformed payload metadata")
        if len(members) <= 1:  # alone (nobody came, or the round failed before a group formed)
            return self._compressed_result([(tokens, payload)], [self.region], start, len(payload),
                                           consistent=formed.consistent, error=formed.error)
        self.payloads.set_group(outer_step, [peer for peer, *_ in formed.members])
        others = [(peer, region, len(payload), digest) for peer, region, _, digest in members
                  if region != self.region]
        remaining = max(1.0, outer.averaging_timeout - (time.monotonic() - start))
        fetched = self.payloads.fetch_all(others, outer_step, timeout=remaining)
        weighted, regions, failed = [], [], []
        for _, region, member_tokens, _ in members:  # sorted by region: the one order every member sums in
            got = payload if region == self.region else fetched[region]
            if isinstance(got, BaseException):
                failed.append(f"{region}: {got!r}"[:200])
                continue
            weighted.append((member_tokens, got))
            regions.append(region)
        self.payloads.wait_served(outer_step, len(payload) * len(others), SERVED_WAIT_SECONDS)
        received = sum(len(p) for region, p in fetched.items() if not isinstance(p, BaseException))
        error = "; ".join(failed) or formed.error
        if failed:
            logger.warning("[%s] round %d: payloads missing (%s); this region's sum differs from the others'",
                           self.region, outer_step, error)
        return self._compressed_result(
            weighted, regions, start, len(payload), consistent=formed.consistent and not failed, error=error,
            bytes_sent=formed.bytes_sent + self.payloads.served(outer_step),
            bytes_received=formed.bytes_received + received, timings=formed.timings)

    def _compressed_result(self, weighted: list[tuple[int, bytes]], regions: list[str], start: float,
                           payload_bytes: int, consistent: bool = True, error: str | None = None,
                           bytes_sent: int = 0, bytes_received: int = 0, timings: dict | None = None) -> RoundResult:
        return RoundResult(self.compressor.aggregate(weighted), len(weighted), sorted(regions), bytes_sent,
                           bytes_received, time.monotonic() - start, consistent, error, dict(timings or {}),
                           payload_bytes=payload_bytes)

    def _stop_compressor(self) -> None:
        if self.payloads is not None:
            self.payloads.shutdown()
            self.payloads = None
