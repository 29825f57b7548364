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
It moves with the round's outer step, never without it: a round abandoned after its payload was made (its Δ then
goes again, inside the next round's) leaves it as it was.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter

import torch

from ray_diloco.methods.compressors import Compressor
from ray_diloco.methods.settings import COMPRESSED, MethodSettings
from ray_diloco.sync.averaging import RoundResult
from ray_diloco.sync.payloads import PayloadExchange, payload_digest

logger = logging.getLogger("ray_diloco.sync.actor")
# The group's all-reduce carries a marker of this many values: hivemind gives every member a part to reduce (a
# member without one would be a client, which the exact all-reduce does not run), so a group of up to 256.
MARKER_VALUES = 256
SERVED_WAIT_SECONDS = 10.0  # after our fetches, how long we wait for the others to have fetched ours


def _checked_members(members: list[tuple[str, dict]], size: int, decoder: str,
                     max_tokens: int) -> tuple[list[tuple[str, str, int, str]], list]:
    """((peer, region, tokens, digest) sorted by region, the peers left out): a peer's metadata must name a region
    no other member claims, a payload of exactly our size for our decoder (method, settings, model, DCT basis)
    with a digest, and tokens in [1, max_tokens] (`ExperimentConfig.max_round_tokens`: the sum is weighted by
    tokens, so no member may outweigh the run's largest region). Every member holds the same list, so every
    member leaves out the same."""
    valid, left_out = [], []
    for peer, data in members:
        try:
            region, tokens = data["region"], data["tokens"]
            ok = (isinstance(region, str) and isinstance(tokens, int) and 0 < tokens <= max_tokens
                  and isinstance(data["payload_digest"], str) and len(data["payload_digest"]) == 32
                  and data["payload_bytes"] == size and data["decoder"] == decoder)
        except (TypeError, KeyError):
            ok = False
        if ok:
            valid.append((peer, region, tokens, data["payload_digest"]))
        else:
            left_out.append(peer)
    claims = Counter(region for _, region, _, _ in valid)  # a region claimed twice: neither claim is trusted
    left_out += [peer for peer, region, _, _ in valid if claims[region] > 1]
    valid = [member for member in valid if claims[member[1]] == 1]
    return sorted(valid, key=lambda member: member[1]), left_out


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
                            expected: int, flags: dict | None = None) -> RoundResult:
        """The round's decoded, token-weighted mean of the group's payloads (runs in an executor thread), with the
        compressor state after it: `Rounds` stores that state when the round's outer step applies, so an abandoned
        round moves neither θ_global nor what the region owes."""
        start = time.monotonic()
        tokens = max(tokens, 1)  # as the dense path: a weight must be positive
        payload, _, state = self.compressor.encode(delta)
        if self.payloads is None or expected == 1:
            result = self._compressed_result([(tokens, payload)], [self.region], start, len(payload))
        else:
            try:
                result = self._exchange_payloads(payload, tokens, outer_step, expected, start, flags or {})
            except Exception as error:  # the region goes on alone this round rather than dying
                self.record_event("averaging_error", error=repr(error)[:300])
                logger.warning("[%s] round %d: the payload exchange failed (%r); using the own payload",
                               self.region, outer_step, error)
                result = self._compressed_result([(tokens, payload)], [self.region], start, len(payload),
                                                 consistent=False, error=repr(error))
        return dataclasses.replace(result, method_state=state)

    def _exchange_payloads(self, payload: bytes, tokens: int, outer_step: int, expected: int,
                           start: float, flags: dict) -> RoundResult:
        # The next round's averager (a forked process) starts only after our payloads are fetched and served: a
        # fork would hold every stream open at that moment open in the child too, and its peer would never see
        # the stream end (measured: a fetch hung until its timeout whenever the fork fell inside it).
        try:
            formed, result = self._form_and_fetch(payload, tokens, outer_step, expected, start, flags)
            return dataclasses.replace(result, members=formed.members)  # the group's flags (a stop)
        finally:
            self.averager.prepare_next_round()

    def _form_and_fetch(self, payload: bytes, tokens: int, outer_step: int, expected: int,
                        start: float, flags: dict) -> tuple[RoundResult, RoundResult]:
        """The group formed (its gather) and the round's result."""
        self.payloads.offer(outer_step, payload)
        decoder = self.compressor.decoder_digest()
        formed = self.averager.average(
            {"round": torch.ones(MARKER_VALUES)}, weight=float(tokens), round_index=outer_step,
            expected_regions=expected, checked_finite=True, prepare_next=False,
            gather={**flags, "payload_bytes": len(payload), "payload_digest": payload_digest(payload),
                    "tokens": tokens, "decoder": decoder})
        for peer, what in self.averager.take_rejections():
            self.peer_rejected(peer, what)
        own_peer = str(self.averager.dht.peer_id)
        bound = self.config.max_round_tokens()
        members, left_out = _checked_members(formed.members, len(payload), decoder, bound)
        for peer in left_out:
            if peer != own_peer:
                self.peer_rejected(peer, "a round with malformed or conflicting payload metadata")
        if not any(peer == own_peer for peer, *_ in members) or len(members) <= 1:
            # Alone: nobody came, the round failed before a group formed, or another peer claimed our region.
            return formed, self._compressed_result([(tokens, payload)], [self.region], start, len(payload),
                                                   consistent=formed.consistent and len(members) <= 1,
                                                   error=formed.error)
        self.payloads.set_group(outer_step, [peer for peer, *_ in formed.members])
        weighted, regions, failed, received = self._fetch_members(members, own_peer, payload, outer_step, start)
        self.payloads.wait_served(outer_step, len(members) - 1, SERVED_WAIT_SECONDS)
        error = "; ".join(failed) or formed.error
        if failed:
            logger.warning("[%s] round %d: payloads missing (%s); this region's sum differs from the others'",
                           self.region, outer_step, error)
        return formed, self._compressed_result(
            weighted, regions, start, len(payload), consistent=formed.consistent and not failed, error=error,
            bytes_sent=formed.bytes_sent + self.payloads.served(outer_step),
            bytes_received=formed.bytes_received + received, timings=formed.timings)

    def _fetch_members(self, members: list, own_peer: str, payload: bytes, outer_step: int, start: float):
        """(token weight, decoded payload) of every member in region order, the regions, what failed, the bytes
        received. A payload that arrived intact (its digest) but does not decode is left out by every member
        alike (the digest pins its bytes, so every member reaches the same verdict): the round stays consistent."""
        others = [(peer, region, len(payload), digest) for peer, region, _, digest in members if peer != own_peer]
        remaining = max(1.0, self.config.outer.averaging_timeout - (time.monotonic() - start))
        fetched = self.payloads.fetch_all(others, outer_step, timeout=remaining)
        weighted, regions, failed = [], [], []
        for peer, region, member_tokens, _ in members:  # sorted by region: the one order every member sums in
            got = payload if peer == own_peer else fetched[region]
            if isinstance(got, BaseException):
                failed.append(f"{region}: {got!r}"[:200])
                continue
            try:
                weighted.append((member_tokens, self.compressor.decode_payload(got)))
                regions.append(region)
            except ValueError as error:
                self.peer_rejected(peer, f"an undecodable payload ({error})"[:200])
        received = sum(len(p) for p in fetched.values() if not isinstance(p, BaseException))
        return weighted, regions, failed, received

    def _compressed_result(self, weighted: list[tuple[int, bytes | dict]], regions: list[str], start: float,
                           payload_bytes: int, consistent: bool = True, error: str | None = None,
                           bytes_sent: int = 0, bytes_received: int = 0, timings: dict | None = None) -> RoundResult:
        """`weighted`: (tokens, payload or its decoded parts) in region order."""
        decoded = [(w, parts if isinstance(parts, dict) else self.compressor.decode_payload(parts))
                   for w, parts in weighted]
        averaged, scales = self.compressor.aggregate_decoded(decoded)
        clipped = {region: scale for region, scale in zip(regions, scales) if scale < 1.0}
        return RoundResult(averaged, len(weighted), sorted(regions), bytes_sent, bytes_received,
                           time.monotonic() - start, consistent, error, dict(timings or {}),
                           payload_bytes=payload_bytes, clipped=clipped)

    def _stop_compressor(self) -> None:
        if self.payloads is not None:
            self.payloads.shutdown()
            self.payloads = None
