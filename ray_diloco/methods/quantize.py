"""SparseLoCo's few-bit quantizer of the values a region sends, and the packing of its codes.

As SparseLoCo's code (`n_bins` = 2^bits, range 6σ): over all values v of one tensor, μ = mean(v), σ = their
standard deviation, step s = 6σ / n_bins; code = clamp(round((v − μ)/s + n_bins/2), 0, n_bins − 1); a receiver
reads code b as table[b] = μ + (the mean of v − μ over the values coded b). The sender computes the table
in fp32 and sends it, so decoding is a lookup: no arithmetic that another CPU could round differently. An empty
bin's entry is its bin centre (never read).
"""

from __future__ import annotations

import torch

RANGE_SIGMAS = 6.0  # SparseLoCo's `range`: the bins span 6σ


def quantize(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 of `values`' shape, table fp32 of 2^bits entries): `table[codes]` is the dequantized value."""
    if not 1 <= bits <= 8:
        raise ValueError(f"quantization bits must lie in [1, 8], got {bits}")
    bins = 2 ** bits
    v = values.float().reshape(-1)
    mean = v.mean() if v.numel() else torch.tensor(0.0)
    centred = v - mean
    sigma = float(centred.std()) if v.numel() > 1 else 0.0
    step = RANGE_SIGMAS * sigma / bins or 1.0  # all values equal: every code is the middle bin
    codes = torch.clamp(torch.round(centred / step + bins // 2), 0, bins - 1).to(torch.uint8)
    table = torch.empty(bins, dtype=torch.float32)
    for b in range(bins):
        chosen = centred[codes == b]
        offset = chosen.mean() if chosen.numel() else torch.tensor((b - bins // 2) * step)
        table[b] = mean + offset
    return codes.reshape(values.shape), table


def dequantize(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[codes.long()]


def pack_codes(codes: torch.Tensor, bits: int) -> bytes:
    """`bits`-bit codes, 8 // bits per byte, little end first (bits must divide 8)."""
    if 8 % bits:
        raise ValueError(f"packing needs bits dividing 8, got {bits}")
    per_byte = 8 // bits
    flat = codes.reshape(-1).to(torch.int32)
    padded = torch.zeros(-(-flat.numel() // per_byte) * per_byte, dtype=torch.int32)
    padded[:flat.numel()] = flat
    groups = padded.view(-1, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.int32) * bits
    return (groups << shifts).sum(dim=1).to(torch.uint8).numpy().tobytes()


def unpack_codes(data: bytes, count: int, bits: int) -> torch.Tensor:
    """The `count` codes `pack_codes` packed; `data` must be exactly that long."""
    per_byte = 8 // bits
    if len(data) != -(-count // per_byte):
        raise ValueError(f"{len(data)} bytes of codes, expected {-(-count // per_byte)} for {count} codes")
    packed = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int32)
    shifts = torch.arange(per_byte, dtype=torch.int32) * bits
    codes = (packed[:, None] >> shifts) & (2 ** bits - 1)
    return codes.reshape(-1)[:count].to(torch.uint8)
