"""The DiLoCo outer step in plain PyTorch: θ_global, pseudo-gradients, weighted averaging, Nesterov SGD.

Sign convention (as torchft): Δ = θ_global − θ_local is used as a *gradient*, so an ordinary SGD step
θ_global ← θ_global − lr·Δ moves θ_global toward the regions. With lr 1 and momentum 0 the outer step
is FedAvg: θ_global becomes the (weighted) average of the regions' parameters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from ray_diloco.codecs import get_codec


def pseudo_gradient(
    global_params: Mapping[str, torch.Tensor], local_params: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Δ = θ_global − θ_local in fp32, by parameter name."""
    missing = set(global_params) ^ set(local_params)
    if missing:
        raise KeyError(f"parameter names differ between θ_global and θ_local: {sorted(missing)[:5]}")
    return {name: global_params[name].float() - local_params[name].detach().float().cpu() for name in global_params}


def weighted_average(
    deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], compression: str = "none"
) -> dict[str, torch.Tensor]:
    """Σ wᵢ·decode(encode(Δᵢ)) / Σ wᵢ, accumulated in fp32 (weights are tokens trained)."""
    if len(deltas) != len(weights) or not deltas:
        raise ValueError(f"need one weight per pseudo-gradient, got {len(deltas)} and {len(weights)}")
    if any(w <= 0 for w in weights):
        raise ValueError(f"weights must be positive (tokens trained), got {list(weights)}")
    codec = get_codec(compression)
    total = float(sum(weights))
    averaged = {}
    for name in deltas[0]:
        acc = torch.zeros_like(deltas[0][name], dtype=torch.float32)
        for delta, weight in zip(deltas, weights):
            acc.add_(codec.roundtrip(delta[name]), alpha=weight / total)
        averaged[name] = acc
    return averaged


class OuterOptimizer:
    """Holds θ_global (fp32, full tensors by name, on CPU) and Nesterov SGD over it."""

    def __init__(
        self, global_params: Mapping[str, torch.Tensor], lr: float = 0.7, momentum: float = 0.9,
        nesterov: bool = True,
    ):
        # Own copies: callers keep their tensors, and the outer state never lives on the accelerator.
        self.params = {name: torch.nn.Parameter(t.detach().float().cpu().clone(), requires_grad=False)
                       for name, t in global_params.items()}
        self.optimizer = torch.optim.SGD(
            list(self.params.values()), lr=lr, momentum=momentum, nesterov=nesterov
        )
        self.step_count = 0

    def global_state(self) -> dict[str, torch.Tensor]:
        """θ_global (views of the live tensors: clone before mutating)."""
        return {name: p.data for name, p in self.params.items()}

    def pseudo_gradient(self, local_params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return pseudo_gradient(self.global_state(), local_params)

    @torch.no_grad()
    def step(self, averaged_delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Apply the averaged pseudo-gradient as the gradient of θ_global; return the new θ_global."""
        for name, param in self.params.items():
            param.grad = averaged_delta[name].float().reshape(param.shape).clone()
        self.optimizer.step()
        for param in self.params.values():
            param.grad = None
        self.step_count += 1
        return self.global_state()

    def momentum_state(self) -> dict[str, torch.Tensor]:
        """The momentum buffers by parameter name (absent before the first step)."""
        state = self.optimizer.state
        return {name: state[p]["momentum_buffer"] for name, p in self.params.items()
                if p in state and state[p].get("momentum_buffer") is not None}

    def load_momentum(self, buffers: Mapping[str, torch.Tensor]) -> None:
        for name, buffer in buffers.items():
            self.optimizer.state[self.params[name]]["momentum_buffer"] = buffer.float().clone()


def state_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """A short hash of tensors by name: equal digests mean bit-identical state (used across regions)."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()
