"""Wire codecs for pseudo-gradients: what a region sends, decoded back to fp32 for accumulation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP16_MAX = torch.finfo(torch.float16).max  # 65504


@dataclass(frozen=True)
class Codec:
    name: str
    wire_dtype: torch.dtype

    @property
    def bytes_per_element(self) -> int:
        return torch.tensor([], dtype=self.wire_dtype).element_size()

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().float()
        if self.wire_dtype == torch.float16:
            # Clamp rather than overflow: an inf in one pseudo-gradient would poison θ_global everywhere.
            tensor = tensor.clamp(-FP16_MAX, FP16_MAX)
        return tensor.to(self.wire_dtype)

    def decode(self, wire: torch.Tensor) -> torch.Tensor:
        return wire.float()

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(tensor))

    def wire_bytes(self, tensors: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() for t in tensors.values()) * self.bytes_per_element


CODECS = {
    "none": Codec("none", torch.float32),
    "bf16": Codec("bf16", torch.bfloat16),
    "fp16": Codec("fp16", torch.float16),
}


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        raise ValueError(f"compression {name!r} is unknown; choose one of {sorted(CODECS)}")
    return CODECS[name]
