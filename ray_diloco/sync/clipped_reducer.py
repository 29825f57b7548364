"""The dense all-reduce's reducer under `outer.aggregation: clipped` (ray_diloco.sync.aggregation).

Hivemind's TensorPartReducer adds each sender's part to a running sum as it arrives. Clipping to the median norm
needs every sender's part first, so here the sum is replaced by a list of the contributions: hivemind still does
the bookkeeping (which part is current, who has sent it, banned senders, the future each sender awaits); when
the part is complete, `aggregation.combine` clips and averages it in sender order, and each sender gets that
one result (so every peer holds the same bytes, as with the stock reducer).

Hivemind internals used (hivemind 1.1.x, see hivemind_exact's list): TensorPartReducer's `accumulate_part`
(calls `accumulator.add_(part, alpha=weight)`), `check_current_part_finished`, `reset_accumulators`,
`accumulator`, `current_part_future`, `current_part_accumulated_from`, `num_current_senders`, `finished`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hivemind.averaging.partition import TensorPartReducer

from ray_diloco.sync.aggregation import combine


class _Contributions:
    """Stands in for the reducer's running sum: keeps (sender, weight, part) until the part is complete."""

    def __init__(self, sender_of: dict[int, int]):
        self.sender_of, self.items = sender_of, []

    def add_(self, part: torch.Tensor, alpha: float = 1.0) -> _Contributions:
        self.items.append((self.sender_of.pop(id(part)), float(alpha), part))
        return self


class ClippedPartReducer(TensorPartReducer):
    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, factor: float):
        self.factor = factor
        self._sender_of: dict[int, int] = {}  # id(part) -> its sender, while hivemind hands the part on
        self.scales: dict[int, float] = {}  # sender index -> the smallest scale any of its parts got
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _Contributions(self._sender_of)

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        self._sender_of[id(tensor_part)] = sender_index
        try:
            return await super().accumulate_part(sender_index, part_index, tensor_part, weight=weight)
        finally:
            self._sender_of.pop(id(tensor_part), None)  # refused before it was added (a banned sender)

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        items = sorted(self.accumulator.items, key=lambda item: item[0])  # sender order: one result
        if not items:  # every sender of this part failed: nothing to average (the round is inconsistent)
            self.current_part_future.set_result(torch.zeros(self.part_shapes[self.current_part_index]))
            self.reset_accumulators()
            return
        combined, scales = combine([(weight, part) for _, weight, part in items], "clipped", self.factor)
        for (sender, _, _), scale in zip(items, scales):
            self.scales[sender] = min(scale, self.scales.get(sender, 1.0))
        self.current_part_future.set_result(combined)
        self.reset_accumulators()
