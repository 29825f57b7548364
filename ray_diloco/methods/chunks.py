"""Cutting a tensor into fixed-size chunks and back: the unit both compressed outer methods select in.

A tensor is flattened (row-major) and cut into chunks of `size` consecutive values; the last chunk is padded
with zeros. SparseLoCo picks its top-k per chunk, the DCT method transforms each chunk. The papers tile a matrix
into s×s blocks (DeMo's 2D DCT); we cut the flattened tensor instead: every shape is handled the same way, a
chunk is a piece of one row when the row length is a multiple of `size` (true of every matrix of our presets for
size ≤ 64), and the decode, which must be bit-identical on every region, is one fixed-order pass per axis
instead of two.
"""

from __future__ import annotations

import torch


def chunk_count(numel: int, size: int) -> int:
    return -(-numel // size)


def to_chunks(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """(chunks, size) fp32: the flattened tensor, zero-padded to a whole number of chunks (a copy)."""
    flat = tensor.detach().reshape(-1).float()
    padded = torch.zeros(chunk_count(flat.numel(), size) * size, dtype=torch.float32)
    padded[:flat.numel()] = flat
    return padded.view(-1, size)


def from_chunks(chunks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The tensor of `shape` that `to_chunks` cut (the padding dropped)."""
    numel = 1
    for dim in shape:
        numel *= dim
    return chunks.reshape(-1)[:numel].reshape(shape).clone()


def top_k_per_chunk(chunks: torch.Tensor, k: int, valid: int | None = None) -> torch.Tensor:
    """Indices (chunks, k) of the k largest |values| of each chunk, ascending within a chunk (the payload's
    canonical order: a decoder can then require strictly increasing indices, so no index repeats). `valid`: the
    tensor's own values (the rest is padding), chosen before any padding is."""
    if not 1 <= k <= chunks.shape[1]:
        raise ValueError(f"k must lie in [1, {chunks.shape[1]}], got {k}")
    magnitude = chunks.abs()
    if valid is not None and valid < chunks.numel():
        magnitude.view(-1)[valid:] = -1.0
    indices = torch.topk(magnitude, k, dim=1, sorted=False).indices
    return torch.sort(indices, dim=1).values


def scatter_chunks(indices: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    """Dense (chunks, size) with `values` at `indices` per chunk and 0 elsewhere (indices unique per chunk)."""
    dense = torch.zeros(indices.shape[0], size, dtype=torch.float32)
    dense.scatter_(1, indices.long(), values.float())
    return dense
