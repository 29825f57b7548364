"""Per-step loss and timing off the hot path: each inner step only appends a device tensor and a timing mark;
every `every` steps (and before each exchange, which synchronizes anyway) `flush` turns them into numbers with
one collective and one host sync for all of them.

Before this, every inner step ran a `dist.all_reduce` of its loss (an extra collective) and a `.item()` (a
host sync that stops the CPU from queueing the next step's kernels), and timed itself with `perf_counter`
without synchronizing the device, so on a GPU a rank's step time was the time to *queue* it: tokens/s and MFU
of ranks > 0 were wrong. Timing: on CUDA a `torch.cuda.Event` after each step (elapsed times read at the
flush, after the last event completes: a step's time is the device's time from the previous mark); on the CPU
(gloo) the work is synchronous and `perf_counter` is right. `benchmarks/overhead.py --step-log` measures both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class StepRecord:
    step: int  # inner step of the run, 1-based
    loss: float  # the group's mean loss of this step
    seconds: float  # this step's time on the device (CUDA) or the wall clock (CPU)
    tokens: int  # tokens this rank trained in the step
    lr: float  # the inner learning rate the step used (the scheduler's: a host value, no sync)


class StepLog:
    """Collects steps between flushes. All ranks must flush at the same steps (the loss mean is a collective)."""

    def __init__(self, device: torch.device, world_size: int, every: int):
        self.device, self.world_size, self.every = device, world_size, max(1, every)
        self.cuda = device.type == "cuda"
        # Per recorded step: (step, loss on the device, its end mark: a CUDA event or perf_counter(), tokens, lr).
        self._pending: list[tuple[int, torch.Tensor, object, int, float]] = []
        self._start = self._mark()

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def restart_clock(self) -> None:
        """Time the next step from now (after an exchange or a checkpoint: their time is not a step's)."""
        self._start = self._mark()

    def record(self, step: int, loss: torch.Tensor, tokens: int, lr: float) -> bool:
        """Note a finished step (no sync); True when it is time to flush."""
        self._pending.append((step, loss.detach().float().reshape(()), self._mark(), tokens, lr))
        return len(self._pending) >= self.every

    def flush(self) -> list[StepRecord]:
        """The steps recorded since the last flush, as numbers: one all_reduce (group size > 1) and one host sync."""
        if not self._pending:
            return []
        steps, losses, marks, tokens, lrs = zip(*self._pending)
        losses = torch.stack(losses)
        if self.world_size > 1:
            dist.all_reduce(losses, op=dist.ReduceOp.AVG)
        values = losses.tolist()  # the host sync
        marks = [self._start, *marks]
        if self.cuda:
            marks[-1].synchronize()
            seconds = [a.elapsed_time(b) / 1000.0 for a, b in zip(marks, marks[1:])]
        else:
            seconds = [b - a for a, b in zip(marks, marks[1:])]
        self._pending = []
        self._start = self._mark()  # the flush's own sync and collective are no step's time
        return [StepRecord(*fields) for fields in zip(steps, values, seconds, tokens, lrs)]
