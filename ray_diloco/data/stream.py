"""A region's batches by position: batch i of the region's stream is the same windows whoever asks, so the data
position is one number for the whole region, whatever its worker count.

A region's stream is its Ray Data dataset read in order (`preserve_order`), `batch_size` windows per batch,
epoch after epoch (every epoch is the same sequence). Rank r of a group of W that starts at region position p
trains on batches p + r, p + W + r, p + 2W + r, … (see `batches.WorkerBatches`). A group of another size — after
the autoscaler added or removed nodes, or a node was lost — starts at the position the region's last completed
round recorded and goes on with no window twice and none skipped.

`RegionStream` is the one reader of a region's dataset: a Ray actor that keeps a small buffer of batches read
ahead for the other ranks. It is a cache, nothing more: any batch can be read again from the dataset, so the
actor restarts (a lost node) with nothing to recover but its dataset, built again from the same recipe (the
region's file list; its files are listed again), and a request for a batch it no longer holds re-reads.
Ray Train's own split (`streaming_split`) cannot do this: which rows a rank gets depends on the worker count.

Cost: a group that (re)starts behind the reader — every restart, resize or resume — makes it re-read the current
epoch up to the group's position (Ray Data cannot seek): time linear in the position within the epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import ray

from ray_diloco.data.pipeline import COLUMN

# Batches read ahead for other ranks (about prefetch × workers while ranks train in lockstep); past this the oldest
# go, and are re-read if asked for.
MAX_BUFFERED = 1024

Anchor = dict[str, int]  # a known position: {"batches": index of the next batch, "epoch", "epoch_batches"}


class PositionalReader:
    """Batch `index` of an endless, epoch-repeating stream. `new_epoch()` gives one epoch's batches in order."""

    def __init__(self, new_epoch: Callable[[], Iterator[np.ndarray]], no_batch_error: Callable[[], Exception]):
        self._new_epoch, self._no_batch_error = new_epoch, no_batch_error
        self.buffer: dict[int, tuple[np.ndarray, int, int]] = {}
        self._iter: Iterator[np.ndarray] | None = None
        self.next_index = self.epoch = self.epoch_batches = 0
        self.rewinds = 0  # how often a batch had to be read again (a group restarted behind the reader)

    def take(self, index: int, anchor: Anchor | None = None) -> tuple[np.ndarray, int, int]:
        """(windows, epoch, batches of that epoch read up to and including this one). `anchor`: a position at
        or before `index` whose epoch is known (the group's start), where a rewind starts reading."""
        if index in self.buffer:
            return self.buffer.pop(index)
        if self._iter is None or index < self.next_index:
            self._rewind(anchor or {"batches": 0, "epoch": 0, "epoch_batches": 0}, index)
        while self.next_index < index:  # read ahead: the other ranks ask for these next
            ahead = self.next_index  # read first: _read moves next_index on
            self.buffer[ahead] = self._read()
            if len(self.buffer) > MAX_BUFFERED:
                del self.buffer[min(self.buffer)]
        return self._read()

    def _rewind(self, anchor: Anchor, index: int) -> None:
        if anchor["batches"] > index:
            raise ValueError(f"batch {index} asked for with an anchor after it ({anchor})")
        if self._iter is not None:
            self.rewinds += 1
        # Start the anchor's epoch and read past its consumed part (the epoch is the same sequence every time).
        self.epoch, self.epoch_batches = anchor["epoch"], 0
        self.next_index = anchor["batches"] - anchor["epoch_batches"]
        self._start_epoch()
        for _ in range(anchor["epoch_batches"]):
            self._read()

    def _start_epoch(self) -> None:
        self.close()  # the abandoned epoch's reader stops its threads now, not whenever it is collected
        self._iter = self._new_epoch()

    def close(self) -> None:
        """Stop reading: closes the epoch's iterator (a generator: its `finally` ends the dataset's reader)."""
        close = getattr(self._iter, "close", None)
        if close is not None:
            close()
        self._iter = None

    def _read(self) -> tuple[np.ndarray, int, int]:
        batch = next(self._iter, None)
        if batch is None and self.epoch_batches > 0:  # the epoch is used up: start the next one
            self.epoch, self.epoch_batches = self.epoch + 1, 0
            self._start_epoch()
            batch = next(self._iter, None)
        if batch is None:  # a whole epoch without a batch: every later one is empty too
            raise self._no_batch_error()
        self.next_index += 1
        self.epoch_batches += 1
        return batch, self.epoch, self.epoch_batches


def _quiet_data_context() -> None:
    """No Ray Data progress bars or execution plans in this process: they interleave with the run's status lines
    (through Ray's log stream), and the per-step lines say more."""
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = context.print_on_execution_start = False


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class RegionStream:
    """The reader of one region's dataset (see the module docstring). `counters`: a `DataCounters` handle or
    `ActorByName`, only for the skipped-record count in the error raised when the data has no batch at all.

    The dataset is built here, from its recipe (`pipeline.region_dataset_recipes`): a built dataset passed in would
    carry object refs in this actor's arguments, which Ray logs as an error at every start. It is built on first
    use, not in the constructor: Ray never restarts an actor whose constructor raised, so a passing error (S3, the
    Hub) while a restarted stream lists its files would end the region's data for good; here it fails that call,
    and the next one tries again. The driver calls `prepare` first, so that bad data fails the run at its start."""

    def __init__(self, make_dataset: Callable[[], ray.data.Dataset], batch_size: int, counters: Any = None):
        self.make_dataset, self.batch_size, self.counters = make_dataset, batch_size, counters
        self.dataset: ray.data.Dataset | None = None
        self.reader = PositionalReader(self._new_epoch, self._no_batch_error)

    def prepare(self) -> None:
        """Build the dataset now (listing its files): its errors reach the driver before any training starts."""
        self._built()

    def _built(self) -> ray.data.Dataset:
        if self.dataset is None:
            _quiet_data_context()
            dataset = self.make_dataset()
            dataset.context.execution_options.preserve_order = True  # the same order in every read
            self.dataset = dataset
        return self.dataset

    def _new_epoch(self) -> Iterator[np.ndarray]:
        batches = iter(self._built().iter_batches(batch_size=self.batch_size, batch_format="numpy",
                                                  drop_last=True))
        try:
            for batch in batches:
                yield batch[COLUMN]
        finally:  # closed mid-epoch (a rewind, the end of the run): Ray Data's executor and prefetch threads end
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def take(self, index: int, anchor: Anchor | None = None) -> tuple[np.ndarray, int, int]:
        return self.reader.take(index, anchor)

    def close(self) -> None:
        """The run is over: stop the dataset's reader. The driver calls this before `ray.kill`, so the process
        never ends with Ray Data's executor and prefetch threads still reading."""
        self.reader.close()

    def _no_batch_error(self) -> RuntimeError:
        # A bare StopIteration here used to surface only after Ray Train restarted the worker group.
        skipped = ""
        if self.counters is not None:
            try:
                count = ray.get(self.counters.get.remote(), timeout=10)["skipped"]
                skipped = f" ({count} record(s) skipped so far in this run's data)"
            except Exception as error:  # the count is a hint; the error below must still be raised
                skipped = f" (skipped-record count unavailable: {error!r})"
        return RuntimeError(
            f"no training windows in this region's data: an epoch yielded no batch of {self.batch_size} "
            "windows; check data.path and the skipped-record count (records without a string 'text' are "
            f"skipped){skipped}")
