"""The inner optimizer every worker runs between outer steps: AdamW with linear warmup and cosine decay."""

from __future__ import annotations

import math

import torch

from ray_diloco.config import InnerOptConfig
from ray_diloco.sync.codecs import count_nonfinite


def lr_multiplier(step: int, cfg: InnerOptConfig, total_steps: int) -> float:
    """Factor on cfg.lr at inner step `step` (0-based) of `total_steps` in the whole run."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_inner_optimizer(
    params, cfg: InnerOptConfig, total_steps: int, device: torch.device
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW: one fused kernel over all parameters on a GPU (the per-parameter loop launched ~10 kernels per
    tensor, each a pass over memory); on a CPU the plain loop, since foreach kernels are not implemented for
    every DTensor placement on gloo. The moments are the same either way; a loaded checkpoint keeps the kernels
    chosen here (`load_worker_checkpoint`)."""
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
        fused=fused, foreach=None if fused else False,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))
    return optimizer, scheduler


def reset_nonfinite_state(optimizer: torch.optim.Optimizer) -> int:
    """Forget the AdamW moments of every parameter whose state holds a NaN or inf; returns how many.

    A region whose pseudo-gradient was non-finite sits the round out and takes its peers' θ_global, but one
    NaN gradient has already poisoned its moments: the next step would make θ NaN again, and the region would
    sit out every round after. Fresh moments (AdamW re-creates them on the next step) let it rejoin."""
    poisoned = []
    for param, state in optimizer.state.items():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                local = value.to_local() if hasattr(value, "to_local") else value
                if count_nonfinite(local):  # a vectorised sum first: this runs after every exchange
                    poisoned.append(param)
                    break
    for param in poisoned:
        del optimizer.state[param]
    return len(poisoned)
