"""The outer methods' names and settings, and the other names the config and the CLI check (wire codecs,
aggregations): torch-free, so a bad flag is refused before torch is imported (~2 s idle, far more on a busy
machine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config.py imports this module
    from ray_diloco.config import OuterConfig

METHODS = ("diloco", "sparseloco", "dct")
CODEC_NAMES = ("none", "bf16", "fp16", "scaled-fp16")  # ray_diloco.sync.codecs.CODECS, which checks it
COMPRESSED = ("sparseloco", "dct")
AGGREGATIONS = ("mean", "clipped")  # how a round combines the regions' contributions (ray_diloco.sync.aggregation)
# SparseLoCo: its paper's and code's settings, 4096 values per chunk (its 64×64 blocks) with top-128 (3.1 %),
# 2-bit values, β = 0.95. dct: ours, not a paper's. DeMo's code uses 2D 64×64 blocks with top-32 (0.8 %) and
# β = 0.999 per inner step; we cut 1D chunks of 64 (chunks.py says why) and take k = 2 (1/32 of the
# coefficients; fp16 values and 6-bit indices: 0.69 bit per parameter, 23× fewer bytes than fp16 DiLoCo, for
# the bar of 16×), with SparseLoCo's per-round β = 0.95 (one decay per round of H steps, not per step).
DEFAULTS = {"sparseloco": {"chunk_size": 4096, "topk": 128}, "dct": {"chunk_size": 64, "topk": 2}}
# SparseLoCo's outer learning rate α (plain SGD); dct's too (its validation sweep's best, 1.6, is 0.04 lower: inside
# the noise of one short seed, docs/benchmarks.md)
COMPRESSED_LR = 1.0


@dataclass(frozen=True)
class MethodSettings:
    name: str
    chunk_size: int
    topk: int
    bits: int  # sparseloco's value bits (dct sends fp16)
    decay: float  # β of the error feedback / of the region's momentum
    # How every member combines the payloads (ray_diloco.sync.aggregation): part of the decoder digest, so members
    # that would sum differently never share a round.
    aggregation: str = "mean"
    clip_factor: float | None = None  # clipped only: under the mean it would split regions for nothing

    @classmethod
    def of(cls, outer) -> "MethodSettings":
        """From an OuterConfig of a compressed method (0 in chunk_size / topk: the method's default)."""
        defaults = DEFAULTS[outer.method]
        return cls(outer.method, outer.chunk_size or defaults["chunk_size"], outer.topk or defaults["topk"],
                   outer.quantization_bits, outer.error_decay, outer.aggregation,
                   outer.clip_factor if outer.aggregation == "clipped" else None)


def describe_outer(outer: OuterConfig) -> str:
    """The outer step of a diloco-mode run in a few words, for the driver's start line: what a round sends and how
    it is applied, so a run with the wrong method or wire shows it before its first round."""
    if outer.method in DEFAULTS:
        method = MethodSettings.of(outer)
        values = (f"values per chunk, {method.bits}-bit" if method.name == "sparseloco"
                  else "DCT coefficients per chunk, fp16")
        sent = f"top-{method.topk} of {method.chunk_size} {values}"
    else:
        sent = f"Δ on a {'fp32' if outer.compression == 'none' else outer.compression} wire"
    step = f"Nesterov lr {outer.lr} momentum {outer.momentum}" if outer.nesterov else f"SGD lr {outer.lr}"
    if outer.momentum and not outer.nesterov:
        step += f" momentum {outer.momentum}"
    combined = (f"clipped at {outer.clip_factor}× the median norm" if outer.aggregation == "clipped"
                else "token-weighted mean")
    return f"outer {outer.method}: H={outer.inner_steps}, {sent}, {combined}, {step}"
