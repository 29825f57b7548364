"""The compressed outer methods: what a region sends each round, its own state, and the decode every region
computes bit for bit alike.

* `sparseloco` (SparseLoCo, arXiv 2508.15706, Algorithm 1 and its code): the region keeps an error-feedback
  buffer e. Each round e ← β·e + Δ; it sends the top-k |e| of every chunk, their values quantized to `bits`
  bits (`quantize.py`); e ← e − (what was sent, dequantized). The outer step is plain SGD (the paper's α = 1, no
  momentum: the error feedback takes its place).
* `dct` (decoupled momentum, arXiv 2510.03371, built as DeMo (arXiv 2411.19870) applied to DiLoCo's
  pseudo-gradient — the form SparseLoCo's code runs as its `demo_diloco` baseline): the region keeps a momentum
  m. Each round m ← β·m + Δ; it sends the k largest DCT coefficients of every chunk of m (the fast-moving
  components: DeMo selects by magnitude), as fp16 with one power-of-two scale per tensor; m ← m − IDCT(sent).
  The outer step is plain SGD on the decoded mean (no sign: DeMo's sign step is for its per-step form).

The aggregate is the token-weighted mean Σ wᵢ·sentᵢ / Σ wᵢ (the paper's (1/R)·Σ for equal tokens; SparseLoCo's
code averages each coordinate over the regions that chose it instead: that scales a coordinate one region alone
sent by R, which the paper's equation does not). It is summed in the order given (sorted regions), each product
and each sum rounded once, and decoded with `dct.inverse_exact`: the same bits on every CPU.

A payload has one layout, fixed by the model's parameters and the settings: a receiver knows its exact size
before reading it, and `decode_payload` checks every field (indices in range and strictly increasing per chunk,
decoded values finite and within ±1e30, a scale one of our encoder's powers of two) before a value is used.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ray_diloco.methods import dct
from ray_diloco.methods.bitpack import index_bits, pack_uints, packed_size, unpack_uints
from ray_diloco.methods.chunks import chunk_count, from_chunks, scatter_chunks, to_chunks, top_k_per_chunk
from ray_diloco.methods.quantize import dequantize, pack_codes, quantize, unpack_codes
from ray_diloco.methods.settings import COMPRESSED, MethodSettings
from ray_diloco.sync.aggregation import scales_of
from ray_diloco.sync.codecs import power_of_two_scale

MAGIC = b"RDM2"  # 2: indices packed in index_bits(chunk_size) bits (RDM1 took 8 or 16)
_METHOD_CODE = {"sparseloco": 1, "dct": 2}
# A decoded value's bound: far beyond any pseudo-gradient, yet a sum over regions and the DCT's inverse (at most
# 64·0.18 times its largest coefficient) stay far below fp32's 3.4e38, so a checked payload never yields inf.
MAX_VALUE = 1e30
_SCALES = frozenset(math.ldexp(1.0, k) for k in range(-126, 127))  # codecs.power_of_two_scale's range


class Compressor:
    """One region's side of a compressed method: its state (error feedback or momentum) and its payloads."""

    def __init__(self, settings: MethodSettings, shapes: Mapping[str, Sequence[int]]):
        if settings.name not in COMPRESSED:
            raise ValueError(f"not a compressed method: {settings.name!r}; one of {COMPRESSED}")
        if not 1 <= settings.topk <= settings.chunk_size <= 65536:
            raise ValueError(f"need 1 <= topk <= chunk_size <= 65536, got {settings.topk} and {settings.chunk_size}")
        self.settings = settings
        self.shapes = {name: torch.Size(shape) for name, shape in sorted(shapes.items())}
        self.state: dict[str, torch.Tensor] = {}  # absent: zero (a fresh, joining or re-synced region)
        # An index within a chunk in the bits its range needs: 12 for SparseLoCo's chunks of 4096, 6 for DCT's 64.
        self._index_bits = index_bits(settings.chunk_size)

    # -- sending ---------------------------------------------------------------------------------------
    def compress(self, delta: Mapping[str, torch.Tensor]) -> tuple[bytes, dict[str, torch.Tensor]]:
        """(payload, what it carries decoded, by name) for this round's Δ; the state moves on."""
        payload, sent, self.state = self.encode(delta)
        return payload, sent

    def encode(self, delta: Mapping[str, torch.Tensor]) -> tuple[bytes, dict[str, torch.Tensor],
                                                                   dict[str, torch.Tensor]]:
        """(payload, what it carries decoded, the state after it) for this round's Δ; the state stays as it was
        until the caller stores the new one (a round may be abandoned after its payload was made: its Δ is then
        sent again in the next round's, so what it owed must not move)."""
        s = self.settings
        parts, sent, state = [MAGIC, bytes([_METHOD_CODE[s.name], s.bits])], {}, {}
        for name, shape in self.shapes.items():
            chunks = to_chunks(delta[name], s.chunk_size)
            previous = self.state.get(name)
            buffer = chunks if previous is None else torch.add(torch.mul(previous, s.decay), chunks)
            signal = dct.forward(buffer) if s.name == "dct" else buffer
            # SparseLoCo picks among the tensor's own values, never its padding (a padded zero would skew the
            # quantizer's mean and σ); a DCT coefficient mixes the whole chunk, padding included.
            indices = top_k_per_chunk(signal, s.topk, valid=shape.numel() if s.name == "sparseloco" else None)
            chosen = torch.gather(signal, 1, indices)
            encoded, values = self._encode_values(chosen)
            sent_chunks = scatter_chunks(indices, values, s.chunk_size)
            if s.name == "dct":
                sent_chunks = dct.inverse(sent_chunks)  # local: only this region subtracts it
            state[name] = torch.sub(buffer, sent_chunks)
            sent[name] = from_chunks(sent_chunks, shape)
            parts += [pack_uints(indices.numpy(), self._index_bits), encoded]
        return b"".join(parts), sent, state

    def _encode_values(self, chosen: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """The selected values' bytes and what a receiver decodes them to."""
        if self.settings.name == "sparseloco":
            codes, table = quantize(chosen, self.settings.bits)
            encoded = table.numpy().astype("<f4").tobytes() + pack_codes(codes, self.settings.bits)
            return encoded, dequantize(codes, table)
        scale = power_of_two_scale(chosen)  # fp16 of x·2^k: no overflow, no subnormals (codecs.py)
        half = torch.mul(chosen, scale).half()
        return struct.pack("<f", scale) + half.numpy().astype("<f2").tobytes(), torch.div(half.float(), scale)

    # -- receiving -------------------------------------------------------------------------------------
    def payload_bytes(self) -> int:
        """The exact size of every payload of these settings and this model."""
        s, total = self.settings, len(MAGIC) + 2
        for shape in self.shapes.values():
            selected = chunk_count(shape.numel(), s.chunk_size) * s.topk
            values = 4 * 2 ** s.bits + -(-selected * s.bits // 8) if s.name == "sparseloco" else 4 + 2 * selected
            total += packed_size(selected, self._index_bits) + values
        return total

    def decode_payload(self, payload: bytes) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """name -> (indices (chunks, k), values (chunks, k) fp32) of a payload from anyone; raises ValueError on any
        field out of bounds. Values are DCT coefficients for 'dct'."""
        s = self.settings
        if len(payload) != self.payload_bytes():
            raise ValueError(f"payload of {len(payload)} bytes, expected {self.payload_bytes()}")
        if payload[:6] != MAGIC + bytes([_METHOD_CODE[s.name], s.bits]):
            raise ValueError("payload of another method, version or bit width")
        offset, decoded = 6, {}
        for name, shape in self.shapes.items():
            chunks = chunk_count(shape.numel(), s.chunk_size)
            count = chunks * s.topk
            indices = torch.from_numpy(unpack_uints(payload, offset, count, self._index_bits)).view(chunks, s.topk)
            offset += packed_size(count, self._index_bits)
            if bool((indices >= s.chunk_size).any()) or bool((indices[:, 1:] <= indices[:, :-1]).any()):
                raise ValueError(f"{name}: indices out of range or not strictly increasing within a chunk")
            values, offset = self._decode_values(payload, offset, count, name)
            decoded[name] = (indices, values.view(chunks, s.topk))
        return decoded

    def _decode_values(self, payload: bytes, offset: int, count: int, name: str) -> tuple[torch.Tensor, int]:
        s = self.settings
        if s.name == "sparseloco":
            table = torch.from_numpy(np.frombuffer(payload, dtype="<f4", count=2 ** s.bits, offset=offset).copy())
            offset += 4 * 2 ** s.bits
            length = -(-count * s.bits // 8)
            codes = unpack_codes(payload[offset:offset + length], count, s.bits)
            if not bool((table.abs() <= MAX_VALUE).all()):  # also false for NaN
                raise ValueError(f"{name}: a quantization level is non-finite or beyond ±{MAX_VALUE:g}")
            return dequantize(codes, table), offset + length
        (scale,) = struct.unpack_from("<f", payload, offset)
        half = torch.from_numpy(np.frombuffer(payload, dtype="<f2", count=count, offset=offset + 4).copy())
        if scale not in _SCALES:  # our encoder's powers of two only: a tiny one would decode fp16 values to inf
            raise ValueError(f"{name}: the scale {scale!r} is not a power of two in [2^-126, 2^126]")
        values = torch.div(half.float(), scale)
        if not bool((values.abs() <= MAX_VALUE).all()):
            raise ValueError(f"{name}: values non-finite or beyond ±{MAX_VALUE:g}")
        return values, offset + 4 + 2 * count

    def aggregate(self, weighted: Sequence[tuple[float, bytes]]) -> dict[str, torch.Tensor]:
        """Σ wᵢ·sᵢ·decode(payloadᵢ) / Σ wᵢ by name (sᵢ: 1 under the mean, the clip scale of `aggregation.py`
        under clipped), summed in the order given, every operation rounded once."""
        return self.aggregate_decoded([(w, self.decode_payload(payload)) for w, payload in weighted])[0]

    def aggregate_decoded(self, weighted: Sequence[tuple[float, dict]]) -> tuple[dict[str, torch.Tensor],
                                                                                 list[float]]:
        """`aggregate` of payloads `decode_payload` has checked and decoded already, and each payload's smallest
        clip scale over the tensors (1.0: not clipped). A tensor's norm is its sent values' (the DCT is
        orthonormal: its coefficients' norm is the chunk's)."""
        if not weighted or any(not w > 0 for w, _ in weighted):
            raise ValueError("need at least one payload, each with a positive weight (tokens)")
        s = self.settings
        total = float(sum(w for w, _ in weighted))
        averaged, smallest = {}, [1.0] * len(weighted)
        for name, shape in self.shapes.items():
            scales = scales_of([parts[name][1] for _, parts in weighted], s.aggregation, s.clip_factor)
            acc = torch.zeros(chunk_count(shape.numel(), s.chunk_size), s.chunk_size)
            for i, ((weight, parts), scale) in enumerate(zip(weighted, scales)):
                indices, values = parts[name]
                share = weight * scale / total  # scale 1.0 (the mean) multiplies exactly: the mean's bits unchanged
                acc = torch.add(acc, torch.mul(scatter_chunks(indices, values, s.chunk_size), share))
                smallest[i] = min(smallest[i], scale)
            if s.name == "dct":
                acc = dct.inverse_exact(acc)
            averaged[name] = from_chunks(acc, shape)
        return averaged, smallest

    # -- state (part of the region's checkpoint) ----------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.state.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in state.items():
            rows = chunk_count(self.shapes[name].numel(), self.settings.chunk_size) if name in self.shapes else -1
            if tuple(tensor.shape) != (rows, self.settings.chunk_size):
                raise ValueError(f"compressor state of {name!r}: shape {tuple(tensor.shape)} does not fit the model")
        self.state = {name: t.float().clone() for name, t in state.items()}

    def decoder_digest(self) -> str:
        """What a payload's meaning depends on: method, settings, the model's parameters and (dct) the basis every
        region computes for itself. Members compare it before exchanging payloads: a region whose settings or
        whose libm's cosines differ is left out alike by all, instead of decoding the same bytes to other values."""
        digest = hashlib.blake2b(repr((self.settings, sorted(self.shapes.items()))).encode(), digest_size=8)
        if self.settings.name == "dct":
            digest.update(dct.dct_basis(self.settings.chunk_size).numpy().tobytes())
        return digest.hexdigest()

    def bits_per_parameter(self) -> float:
        """Bits a region sends per model parameter per round (its payload; the wire adds framing)."""
        return 8.0 * self.payload_bytes() / sum(shape.numel() for shape in self.shapes.values())
