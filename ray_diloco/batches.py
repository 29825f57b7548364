"""A worker's share of its region's batches: resumable at a region-level position, and fingerprinted.

The region's stream is one sequence of batches (`data.stream.RegionStream`); rank r of a group of W ranks that
starts at region position p trains on batches p + r, p + W + r, … So the position is one number for the region,
and a group of another size (an elastic resize, a restart with fewer nodes) goes on from it exactly.

Every window handed to training is counted and hashed into an order-independent fingerprint (the sum of
64-bit BLAKE2b hashes, mod 2^64). Two runs that trained on the same multiset of windows have the same
(windows, fingerprint); a window seen twice or skipped changes it. `summary.json` reports it per region.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import ray
import torch

_MOD = 1 << 64


def window_fingerprint(windows: np.ndarray) -> int:
    """Sum of the 64-bit hashes of each row (one window of token ids), mod 2^64."""
    total = 0
    for row in np.ascontiguousarray(windows):
        total += int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little")
    return total % _MOD


START: dict[str, Any] = {"batches": 0, "epoch": 0, "epoch_batches": 0, "windows": 0, "fingerprint": "0" * 16}


def region_progress(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The region's position after its ranks' batches (each rank's `WorkerBatches.progress()`, all from the same
    start): the batch after the last one any rank took (ranks train in lockstep, so every earlier one was
    taken), and the windows and fingerprint of everything trained so far (ranks take disjoint batches)."""
    start = ranks[0]["start"]
    last = max(ranks, key=lambda p: p["batches"])
    fingerprint = (int(start["fingerprint"], 16) + sum(int(p["fingerprint"], 16) for p in ranks)) % _MOD
    return {"batches": last["batches"], "epoch": last["epoch"], "epoch_batches": last["epoch_batches"],
            "windows": start["windows"] + sum(p["windows"] for p in ranks), "fingerprint": f"{fingerprint:016x}"}


class WorkerBatches:
    """`next()` gives this rank's next batch of token windows as a long tensor on `device`, from `stream` (the
    region's `RegionStream`). `start`: the region's position where this group begins (`region_progress` of the
    last completed round; None: the beginning). `progress()` is this rank's part of the region's position
    (`region_progress` combines the ranks'). Asks for `prefetch` batches ahead, so reading overlaps the step."""

    def __init__(self, stream: Any, device: torch.device, rank: int, world_size: int,
                 start: dict[str, Any] | None = None, prefetch: int = 2):
        self.stream, self.device = stream, device
        self.rank, self.world_size = rank, world_size
        self.start = dict(start or START)
        self.anchor = {k: self.start[k] for k in ("batches", "epoch", "epoch_batches")}
        self.taken = self.windows = self.fingerprint = 0
        self.position = dict(self.anchor)  # after the last batch this rank took
        self.prefetch = max(1, prefetch)
        self._pending: list[Any] = []  # refs of the next batches, in order
        self._asked = 0

    def _index(self, k: int) -> int:
        return self.anchor["batches"] + k * self.world_size + self.rank

    def _next_array(self) -> np.ndarray:
        while len(self._pending) < self.prefetch:
            self._pending.append(self.stream.take.remote(self._index(self._asked), self.anchor))
            self._asked += 1
        windows, epoch, epoch_batches = ray.get(self._pending.pop(0))
        self.position = {"batches": self._index(self.taken) + 1, "epoch": epoch, "epoch_batches": epoch_batches}
        self.taken += 1
        return windows

    def next(self) -> torch.Tensor:
        windows = self._next_array()
        self.windows += len(windows)
        self.fingerprint = (self.fingerprint + window_fingerprint(windows)) % _MOD
        # astype copies: Ray hands out read-only arrays, which torch would otherwise warn about.
        return torch.from_numpy(windows.astype(np.int64)).to(self.device, non_blocking=True)

    @property
    def epoch(self) -> int:
        return self.position["epoch"]

    def progress(self) -> dict[str, Any]:
        """Where this rank stands and what it trained on since `start` (which travels along: see region_progress)."""
        return {**self.position, "windows": self.windows, "fingerprint": f"{self.fingerprint:016x}",
                "start": self.start}
