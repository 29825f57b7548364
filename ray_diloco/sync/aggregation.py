"""How a round combines the regions' contributions (`outer.aggregation`): `mean`, or `clipped` for a run whose
members might send a poisoned Δ.

- mean: Σ wᵢ·xᵢ / Σ wᵢ, wᵢ the tokens region i trained (DiLoCo's weighted average).
- clipped: each contribution is first scaled down to a norm of at most c × the median of the contributions'
  norms (c = `outer.clip_factor`), then the same weighted mean. This is pre-aggregation clipping to the median
  norm, as in "An Experimental Study of Byzantine-Robust Aggregation Schemes in Federated Learning" (Li et al.,
  2023: updates clipped by the median norm before aggregating) and the static clipping that ARC (arXiv
  2405.14432) adapts. Chosen because it needs no state and no extra round: every input is already at the
  reducer (dense) or at every member (compressed), so the rule is decided identically and θ_global stays
  bit-identical. What it bounds: a member that scales its Δ up (×1000) moves θ_global by at most c × the
  median norm, times its token share (whose declared tokens are bounded too, `max_round_tokens`). What it does
  not: a sign-flipped Δ of ordinary norm passes unclipped (it counts as one region's share); with two regions
  the median is the smaller norm, so a member that sends zeros also clips the other's Δ to zero (a stalled run,
  never a diverged one). The median of an even count is the lower of the two middle values.

A block is clipped on its own: a part of the dense all-reduce (a reducer sees only its parts), a tensor of a
compressed payload. Contributions are summed in the order given (senders', regions'), each operation rounded
once, so whoever combines a block gets the same bits from the same inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ray_diloco.methods.settings import AGGREGATIONS


def lower_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def clip_scales(norms: Sequence[float], factor: float) -> list[float]:
    """The factor each contribution is scaled by: 1 where its norm is within factor × the median norm, else
    (factor × median) / norm."""
    bound = factor * lower_median(norms)
    return [1.0 if norm <= bound else bound / norm for norm in norms]


def exact_norm(block: torch.Tensor) -> float:
    """The L2 norm, the same on every machine: fp32 values squared in fp64 are exact, and `math.fsum` rounds their
    sum once. (A torch or NumPy reduction sums in an order that depends on threads and SIMD width: two members of
    a compressed round, each clipping for itself, could differ in the last bit and so in θ_global.)"""
    return math.sqrt(math.fsum(block.detach().to(torch.float64).square().reshape(-1).tolist()))


def scales_of(blocks: Sequence[torch.Tensor], rule: str, factor: float | None) -> list[float]:
    """Each block's scale under `rule` (1.0 for every block under mean)."""
    if rule not in AGGREGATIONS:
        raise ValueError(f"aggregation {rule!r} is not one of {AGGREGATIONS}")
    if rule == "mean":
        return [1.0] * len(blocks)
    return clip_scales([exact_norm(block) for block in blocks], factor)


def combine(weighted: Sequence[tuple[float, torch.Tensor]], rule: str, factor: float | None) -> tuple[torch.Tensor,
                                                                                                  list[float]]:
    """(Σ wᵢ·sᵢ·xᵢ / Σ wᵢ in fp32, summed in the order given; the scales sᵢ)."""
    if not weighted or any(not w > 0 for w, _ in weighted):
        raise ValueError("need at least one contribution, each with a positive weight (tokens)")
    scales = scales_of([x for _, x in weighted], rule, factor)
    accumulator = torch.zeros(weighted[0][1].shape, dtype=torch.float32)
    for (weight, block), scale in zip(weighted, scales):
        accumulator.add_(block, alpha=weight * scale)
    return accumulator.div_(float(sum(w for w, _ in weighted))), scales
