"""How a region's FSDP2 shards map onto full tensors by name (pure functions, no process group).

FSDP2 shards every parameter on dim 0 as `torch.chunk` does (rank r holds rows
[r·⌈n/W⌉, min((r+1)·⌈n/W⌉, n)), trailing ranks may hold none). The SyncActor keeps full tensors,
so it assembles a region's replica from its ranks' shards and hands each rank back its rows.
Keeping full tensors is what lets regions with different worker counts train together.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch

RowRange = tuple[int, int]  # [start, stop) along dim 0


def shard_rows(num_rows: int, world_size: int, rank: int) -> RowRange:
    """The rows of a dim-0 `torch.chunk` shard that `rank` holds."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    chunk = -(-num_rows // world_size)  # ceil
    start = min(rank * chunk, num_rows)
    return start, min(start + chunk, num_rows)


def assemble(shards_by_rank: Mapping[int, Mapping[str, torch.Tensor]],
             full_shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Concatenate every rank's dim-0 shard into full fp32 tensors; checks that the rows add up."""
    world_size = len(shards_by_rank)
    if sorted(shards_by_rank) != list(range(world_size)):
        raise ValueError(f"need shards from ranks 0..{world_size - 1}, got {sorted(shards_by_rank)}")
    full = {}
    for name, shape in full_shapes.items():
        parts = [shards_by_rank[rank][name].float() for rank in range(world_size)]
        tensor = torch.cat(parts, dim=0)
        if tensor.shape != shape:
            raise ValueError(f"shards of {name} assemble to {tuple(tensor.shape)}, expected {tuple(shape)}")
        full[name] = tensor
    return full


def rows_for_rank(full: Mapping[str, torch.Tensor], world_size: int, rank: int) -> dict[str, torch.Tensor]:
    """Each tensor's rows that `rank` holds (contiguous copies, so Ray ships only those bytes)."""
    out = {}
    for name, tensor in full.items():
        start, stop = shard_rows(tensor.shape[0], world_size, rank)
        out[name] = tensor[start:stop].clone()
    return out


def to_wire(tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """fp32 CPU tensors as numpy arrays (views) for a Ray call between a worker and its SyncActor. Ray puts
    numpy arrays into its object store as raw buffers and the receiver reads them there without a copy; torch
    tensors it pickles (a round trip of the tiny model's 27 MB: 0.043 vs 0.118 s median here, of the 150m
    model's 1 GB: 1.1 vs 10.2 s; benchmarks/exchange.py). Ray copies a call's arguments when the call is
    made, so views of live tensors are safe to pass (tests/test_sharding.py checks it)."""
    return {name: tensor.numpy() for name, tensor in tensors.items()}


def from_wire(arrays: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of `to_wire` (torch tensors pass as they are). Arrays from Ray's object store are read-only;
    what reads them only concatenates or copies them, so torch's warning about that is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: torch.as_tensor(array) for name, array in arrays.items()}
