"""The DiLoCo outer step in plain PyTorch: θ_global, pseudo-gradients, weighted averaging, Nesterov SGD.

Sign convention (as torchft): Δ = θ_global − θ_local is used as a *gradient*, so an ordinary SGD step
θ_global ← θ_global − lr·Δ moves θ_global toward the regions. With lr 1 and momentum 0 the outer step
is FedAvg: θ_global becomes the (weighted) average of the regions' parameters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from ray_diloco.sync.codecs import get_codec


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
    """Holds θ_global (fp32, full tensors by name, on CPU) and Nesterov SGD over it.

    The update is torch.optim.SGD's (dampening 0: buf ← m·buf + Δ, the first step buf = Δ; Nesterov: u = Δ + m·buf,
    else u = buf; θ ← θ − lr·u), written as separately rounded element-wise operations. torch's SGD fuses
    `a + α·b` into one fused multiply-add in its vectorised kernels but not in the scalar ones, so the same step
    gave different bits under ATEN_CPU_CAPABILITY=default and avx2: regions whose SyncActors run on different
    CPUs would diverge every round. A product by a scalar and a sum of two tensors are each rounded once
    (IEEE 754) whatever the kernel, so this θ_global is bit-identical on any CPU.
    """

    def __init__(
        self, global_params: Mapping[str, torch.Tensor], lr: float = 0.7, momentum: float = 0.9,
        nesterov: bool = True,
    ):
        if nesterov and momentum <= 0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        # Own copies: callers keep their tensors, and the outer state never lives on the accelerator.
        self.params = {name: t.detach().float().cpu().clone() for name, t in global_params.items()}
        self.lr, self.momentum, self.nesterov = float(lr), float(momentum), nesterov
        self.buffers: dict[str, torch.Tensor] = {}
        self.step_count = 0

    def global_state(self) -> dict[str, torch.Tensor]:
        """θ_global (the live tensors: clone before mutating)."""
        return dict(self.params)

    def pseudo_gradient(self, local_params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return pseudo_gradient(self.global_state(), local_params)

    @torch.no_grad()
    def step(self, averaged_delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Apply the averaged pseudo-gradient as the gradient of θ_global; return the new θ_global."""
        for name, param in self.params.items():
            grad = averaged_delta[name].float().reshape(param.shape)
            update = grad
            if self.momentum:
                previous = self.buffers.get(name)
                buf = grad.clone() if previous is None else torch.add(torch.mul(previous, self.momentum), grad)
                self.buffers[name] = buf
                update = torch.add(grad, torch.mul(buf, self.momentum)) if self.nesterov else buf
            param.copy_(torch.sub(param, torch.mul(update, self.lr)))
        self.step_count += 1
        return self.global_state()

    def momentum_state(self) -> dict[str, torch.Tensor]:
        """The momentum buffers by parameter name (absent before the first step)."""
        return dict(self.buffers)

    def load_momentum(self, buffers: Mapping[str, torch.Tensor]) -> None:
        unknown = set(buffers) - set(self.params)
        if unknown:
            raise KeyError(f"momentum for unknown parameters: {sorted(unknown)[:5]}")
        wrong = [name for name, buffer in buffers.items() if buffer.shape != self.params[name].shape]
        if wrong:  # a momentum of another shape would broadcast into θ at the next step, or fail there
            raise ValueError(f"momentum of the wrong shape for {sorted(wrong)[:5]}")
        self.buffers = {name: buffer.float().clone() for name, buffer in buffers.items()}


def state_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """A short hash of tensors by name: equal digests mean bit-identical state (used across regions)."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()
