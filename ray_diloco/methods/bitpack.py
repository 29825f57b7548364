"""Indices on the wire in as few bits as their range needs: a chunk of 4096 values takes 12-bit indices (SparseLoCo's
packing), a DCT chunk of 64 takes 6. Each value's low `bits` bits, most significant first, back to back; the last
byte is padded with zeros. Plain numpy bit operations: the same bytes on every machine.
"""

from __future__ import annotations

import numpy as np


def index_bits(chunk_size: int) -> int:
    """Bits an index within a chunk of `chunk_size` values needs (at least 1)."""
    return max(1, (chunk_size - 1).bit_length())


def packed_size(count: int, bits: int) -> int:
    """Bytes `count` values of `bits` bits take."""
    return -(-count * bits // 8)


def pack_uints(values: np.ndarray, bits: int) -> bytes:
    """`values` (non-negative, each below 2^bits, 1 ≤ bits ≤ 32) as a bit string of `bits` bits each."""
    _check_bits(bits)
    flat = np.asarray(values).reshape(-1)
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= 1 << bits):  # before the cast could wrap them
        raise ValueError(f"values from {int(flat.min())} to {int(flat.max())} do not fit in {bits} bits")
    flat = np.ascontiguousarray(flat, dtype=">u4")
    bit_rows = np.unpackbits(flat.view(np.uint8).reshape(-1, 4), axis=1)[:, 32 - bits:]
    return np.packbits(bit_rows.reshape(-1)).tobytes()


def unpack_uints(data: bytes, offset: int, count: int, bits: int) -> np.ndarray:
    """The `count` values `pack_uints` packed at `offset` of `data`, as int64; raises ValueError if `data` is short."""
    _check_bits(bits)
    size = packed_size(count, bits)
    if offset + size > len(data):
        raise ValueError(f"{len(data) - offset} bytes left for {count} values of {bits} bits ({size} bytes)")
    bit_rows = np.unpackbits(np.frombuffer(data, dtype=np.uint8, count=size, offset=offset))[:count * bits]
    padded = np.zeros((count, 32), dtype=np.uint8)
    padded[:, 32 - bits:] = bit_rows.reshape(count, bits)
    return np.packbits(padded, axis=1).view(">u4").reshape(-1).astype(np.int64)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must lie in [1, 32], got {bits}")
