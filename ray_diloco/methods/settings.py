"""The outer methods' names and settings (torch-free: the config checks them before torch is imported)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("diloco", "sparseloco", "dct")
COMPRESSED = ("sparseloco", "dct")
# The papers' settings: SparseLoCo 64×64 blocks (4096 values) with top-128 (3.1 %), 2-bit values, β = 0.95;
# DeMo chunks of 64 with a few coefficients each (k = 2: 1/32 of the coefficients, fp16 values and one-byte
# indices: 0.75 bit per parameter, 21× fewer bytes than fp16).
DEFAULTS = {"sparseloco": {"chunk_size": 4096, "topk": 128}, "dct": {"chunk_size": 64, "topk": 2}}
COMPRESSED_LR = 1.0  # both papers' outer learning rate α (plain SGD)


@dataclass(frozen=True)
class MethodSettings:
    name: str
    chunk_size: int
    topk: int
    bits: int  # sparseloco's value bits (dct sends fp16)
    decay: float  # β of the error feedback / of the region's momentum

    @classmethod
    def of(cls, outer) -> "MethodSettings":
        """From an OuterConfig of a compressed method (0 in chunk_size / topk: the method's default)."""
        defaults = DEFAULTS[outer.method]
        return cls(outer.method, outer.chunk_size or defaults["chunk_size"], outer.topk or defaults["topk"],
                   outer.quantization_bits, outer.error_decay)
