"""The wire codecs of the exact all-reduce (`ray_diloco.sync.exact_allreduce`): hivemind `CompressionBase`s that
encode a part of Δ for the wire and decode it exactly and deterministically, so every peer that decodes the same
bytes holds the same values. Each refuses NaN/inf (a diverged region must not poison the average).

`ray_diloco.sync.codecs` holds the same rounding as plain torch functions (the single-region path and
`outer.weighted_average`); tests/test_codecs.py checks both give the same values. Hivemind internals these rely
on: `NoCompression`'s 2-byte "bfloat16" buffer format and `deserialize_torch_tensor` (see hivemind_exact's list).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    deserialize_torch_tensor,
)
from hivemind.proto import runtime_pb2

from ray_diloco.sync.codecs import SCALE_BYTES, get_codec, require_finite


class _RefuseNonFinite:
    """Mixin: stock Float16Compression clamps inf to ±65504 and passes NaN; nothing non-finite may go out."""

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        require_finite(tensor)
        return super().compress(tensor, info, allow_inplace)


class Float16WireCompression(_RefuseNonFinite, Float16Compression):
    """Stock fp16 bytes (finite values clamped to ±65504, as `ray_diloco.sync.codecs` fp16)."""


class Float32WireCompression(_RefuseNonFinite, NoCompression):
    """Stock fp32 bytes."""


class BFloat16WireCompression(CompressionBase):
    """bf16 on the wire in hivemind's own format: NoCompression's 2-byte "bfloat16" buffer.

    Hivemind has no BFLOAT16 compression type, but `NoCompression.extract` already decodes a "bfloat16"
    tensor whose buffer holds 2 bytes per value (its non-legacy mode), so any hivemind peer reads these
    bytes correctly. Encoding is `ray_diloco.sync.codecs` bf16 (round to nearest even), decoding gives fp32.
    """

    compression_type = runtime_pb2.CompressionType.NONE

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        wire, _ = get_codec("bf16").encode(tensor.detach().cpu())
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=wire.view(torch.int16).numpy().tobytes(),
            size=wire.shape,
            dtype="bfloat16",
            requires_grad=False,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return NoCompression().extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 0.5


class ScaledFloat16WireCompression(CompressionBase):
    """`ray_diloco.sync.codecs` scaled-fp16 per part: buffer = fp16 values of x·s, then s as 4 fp32 bytes.

    It rides on the NONE type with dtype "scaled_float16", which is no numpy dtype: a stock hivemind peer
    refuses these bytes instead of misreading them. Only `decode_part` (all our runner's receive paths)
    decodes it.
    """

    compression_type = runtime_pb2.CompressionType.NONE
    DTYPE = "scaled_float16"

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        wire, scale = get_codec("scaled-fp16").encode(tensor.detach().cpu())
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=wire.numpy().tobytes() + np.float32(scale).tobytes(),
            size=wire.shape,
            dtype=self.DTYPE,
            requires_grad=False,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = torch.Size(serialized_tensor.size)
        buffer = serialized_tensor.buffer
        if len(buffer) != 2 * shape.numel() + SCALE_BYTES:
            raise ValueError(f"a scaled_float16 part of {shape.numel()} values has {len(buffer)} bytes")
        values = np.frombuffer(buffer, dtype=np.float16, count=shape.numel())
        scale = float(np.frombuffer(buffer, dtype=np.float32, offset=2 * shape.numel(), count=1)[0])
        # Our encoder's scales are powers of two in [2^-126, 2^126] (codecs.power_of_two_scale); any other came
        # from no peer of ours (2^-127 and below would decode finite fp16 values to inf).
        if not (math.isfinite(scale) and scale > 0 and math.frexp(scale)[0] == 0.5
                and -126 <= math.frexp(scale)[1] - 1 <= 126):
            raise ValueError(f"a scaled_float16 part has scale {scale}, not a power of two in [2^-126, 2^126]")
        return get_codec("scaled-fp16").decode(torch.from_numpy(values.copy()).reshape(shape), scale)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 0.5


def make_wire_codec(name: str) -> CompressionBase:
    wire = {"fp16": Float16WireCompression, "none": Float32WireCompression, "bf16": BFloat16WireCompression,
            "scaled-fp16": ScaledFloat16WireCompression}
    if name not in wire:
        raise ValueError(f"compression {name!r} is unknown on the hivemind wire; use one of {tuple(wire)}")
    return wire[name]()


def decode_part(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """Any of our wire formats -> fp32 (exact and deterministic: every peer gets the same values). A part that
    decodes to NaN/inf is refused (ValueError): no peer of ours sends one (the encoders refuse them), so it comes
    from a faulty or hostile peer, and averaged in it would leave every region a NaN θ_global."""
    if serialized.dtype == ScaledFloat16WireCompression.DTYPE:
        part = ScaledFloat16WireCompression().extract(serialized)
    else:
        part = deserialize_torch_tensor(serialized).detach().float()
    require_finite(part, "decode")
    return part


def check_part(part: torch.Tensor, expected: torch.Size, weight: float, who: str,
               max_weight: float = math.inf) -> None:
    """A received part against the one it answers (ours of the same index): the same shape (a scalar would
    broadcast over the whole part), and a positive weight of at most `max_weight` (the tokens the run's largest
    region trains in a round: a sender must not outweigh it)."""
    if part.shape != expected:
        raise ValueError(f"{who} sent a part of shape {tuple(part.shape)} for one of {tuple(expected)}")
    if not (math.isfinite(weight) and 0 < weight <= max_weight):
        raise ValueError(f"{who} sent a part with weight {weight} (must lie in (0, {max_weight:g}])")


def roundtrip(codec: CompressionBase, part: torch.Tensor) -> torch.Tensor:
    return decode_part(codec.compress(part, CompressionInfo.from_tensor(part)))
