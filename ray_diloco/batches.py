"""A worker's stream of training batches: endless over epochs, resumable, and fingerprinted.

The stream is the worker's Ray Data shard in a deterministic order (the driver asks Ray Data to preserve
order and to split without locality hints), so "the first n batches" means the same windows in every run
with the same data, seed and worker count. That makes the data position a single number: a resumed or
restarted worker skips the batches it already trained on and goes on with the next window.

Every window handed to training is counted and hashed into an order-independent fingerprint (the sum of
64-bit BLAKE2b hashes, mod 2^64). Two runs that trained on the same multiset of windows have the same
(windows, fingerprint); a window seen twice or skipped changes it. `summary.json` reports it per region.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from ray_diloco.data.pipeline import COLUMN

_MOD = 1 << 64


def window_fingerprint(windows: np.ndarray) -> int:
    """Sum of the 64-bit hashes of each row (one window of token ids), mod 2^64."""
    total = 0
    for row in np.ascontiguousarray(windows):
        total += int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little")
    return total % _MOD


def combine_progress(progress: list[dict[str, Any]]) -> dict[str, Any]:
    """The fingerprint of a group: windows add up, hashes add up mod 2^64 (ranks see disjoint windows)."""
    fingerprint = sum(int(p["fingerprint"], 16) for p in progress) % _MOD
    return {"windows": sum(p["windows"] for p in progress), "fingerprint": f"{fingerprint:016x}"}


class WorkerBatches:
    """`next()` gives the next batch of token windows as a long tensor on `device`; a new epoch starts
    when the shard is used up. `progress()` is what a checkpoint stores; `WorkerBatches(..., progress=p)`
    continues right after it. `counters` (a `DataCounters` handle, optional) only feeds the skipped-record
    count into the error raised when the shard has no batch at all."""

    def __init__(self, shard, batch_size: int, device: torch.device, world_size: int,
                 progress: dict[str, Any] | None = None, counters: Any = None):
        self.shard, self.batch_size, self.device, self.world_size = shard, batch_size, device, world_size
        self.counters = counters
        self.epoch = self.batches = self.epoch_batches = self.windows = self.fingerprint = 0
        self._iter = self._new_epoch()
        if progress:
            if progress["world_size"] != world_size:
                raise ValueError(f"the data position was saved with {progress['world_size']} workers in the "
                                 f"region, now there are {world_size}: each worker's share of the data depends "
                                 "on the worker count; resume with the same number of workers")
            # Every epoch is the same sequence: start the saved epoch and read past its consumed part.
            self.epoch = progress["epoch"]
            self.skip(progress["epoch_batches"])
            self.batches, self.windows = progress["batches"], progress["windows"]
            self.fingerprint = int(progress["fingerprint"], 16)

    def _new_epoch(self):
        # Hashing happens on the host arrays, before the copy to the accelerator.
        return iter(self.shard.iter_batches(batch_size=self.batch_size, batch_format="numpy", drop_last=True))

    def _next_array(self) -> np.ndarray:
        batch = next(self._iter, None)
        if batch is None and self.epoch_batches > 0:  # the epoch is used up: start the next one
            self.epoch += 1
            self.epoch_batches = 0
            self._iter = self._new_epoch()
            batch = next(self._iter, None)
        if batch is None:  # a whole epoch without a batch: every later one is empty too
            raise self._no_batch_error()
        self.batches += 1
        self.epoch_batches += 1
        return batch[COLUMN]

    def _no_batch_error(self) -> RuntimeError:
        # A bare StopIteration here used to surface only after Ray Train restarted the worker group.
        skipped = ""
        if self.counters is not None:
            import ray

            try:
                count = ray.get(self.counters.get.remote(), timeout=10)["skipped"]
                skipped = f" ({count} record(s) skipped so far in this run's data)"
            except Exception as error:  # the count is a hint; the error below must still be raised
                skipped = f" (skipped-record count unavailable: {error!r})"
        return RuntimeError(
            f"no training windows in this worker's data: the epoch yielded no batch of {self.batch_size} "
            "windows; check data.path and the skipped-record count (records without a string 'text' are "
            f"skipped){skipped}")

    def next(self) -> torch.Tensor:
        windows = self._next_array()
        self.windows += len(windows)
        self.fingerprint = (self.fingerprint + window_fingerprint(windows)) % _MOD
        # astype copies: Ray hands out read-only arrays, which torch would otherwise warn about.
        return torch.from_numpy(windows.astype(np.int64)).to(self.device, non_blocking=True)

    def skip(self, batches: int) -> None:
        """Read past `batches` batches without training on them (they were trained on before a restart).
        This re-reads and re-tokenizes them: time linear in the position within the epoch."""
        for _ in range(batches):
            self._next_array()

    def progress(self) -> dict[str, Any]:
        return {"batches": self.batches, "epoch": self.epoch, "epoch_batches": self.epoch_batches,
                "windows": self.windows,
                "fingerprint": f"{self.fingerprint:016x}", "world_size": self.world_size}
