"""One inner step of a region's worker, and the FSDP2 sharding it trains: plain PyTorch, no Ray, so the GPU
benchmarks (`benchmarks/overhead.py --step-log`) run it on a machine with torch alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ray_diloco.config import ExperimentConfig
from ray_diloco.inner import build_inner_optimizer

if TYPE_CHECKING:  # batches.py needs Ray; this module must not
    from ray_diloco.batches import WorkerBatches


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds (the whole tensor when it is not sharded)."""
    data = param.data
    return data.to_local() if isinstance(data, DTensor) else data


def compute_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype forward and backward run in (`inner.precision`): 'auto' is bf16 on a GPU and fp32 on a CPU;
    None means fp32 throughout."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def compile_layers(model: torch.nn.Module) -> None:
    """`inner.compile`: each decoder layer compiled in place (`Module.compile`: its parameters keep their names, so
    state dicts and checkpoints do not change). Per layer rather than the whole model: one graph reused by every
    layer, and FSDP2's per-layer gathers stay outside the compiled code."""
    for layer in model.model.layers:
        layer.compile()


def shard_model(model: torch.nn.Module, device: torch.device, world_size: int, precision: str) -> torch.nn.Module:
    """FSDP2: one `fully_shard` unit per decoder layer, then the root (embeddings, norm, head).

    Under bf16 or fp16, FSDP2's mixed precision: each unit's parameters are gathered in that dtype (half the
    bytes of fp32 on the wire and in memory) and its gradients reduce-scattered in fp32 onto the fp32 shards
    that AdamW steps and the outer step reads. Autocast would instead cast every weight at every matmul and
    gather fp32. Under fp32 nothing is cast."""
    dtype = compute_dtype(precision, device)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


class InnerStep:
    """One inner optimizer step over `grad_accum` micro-batches: zero_grad → forward → backward → step.

    The model is the one `shard_model` wrapped with the same `inner.precision`: FSDP2 casts, so no autocast
    here; fp16 adds a GradScaler (its range is too narrow for unscaled gradients)."""

    def __init__(self, model, cfg: ExperimentConfig, device: torch.device, start_step: int):
        self.model, self.cfg, self.device = model, cfg, device
        self.optimizer, self.scheduler = build_inner_optimizer(model.parameters(), cfg.inner, cfg.total_inner_steps,
                                                               device)
        self.align(start_step)
        fp16 = compute_dtype(cfg.inner.precision, device) == torch.float16
        self.scaler = torch.amp.GradScaler(device.type) if fp16 else None

    def __call__(self, batches: "WorkerBatches") -> tuple[torch.Tensor, int]:
        """Returns the mean loss over the micro-batches (a tensor: no host sync) and the tokens trained."""
        accum, scaler = self.cfg.inner.grad_accum, self.scaler
        loss_sum, tokens = torch.zeros((), device=self.device), 0
        for micro in range(accum):
            input_ids = batches.next()
            # Only the last micro-batch reduce-scatters gradients across the group's ranks.
            self.model.set_requires_gradient_sync(micro == accum - 1)
            loss = self.model(input_ids=input_ids, labels=input_ids).loss / accum
            (scaler.scale(loss) if scaler else loss).backward()
            loss_sum += loss.detach()
            tokens += input_ids.numel()
        if scaler:
            scaler.unscale_(self.optimizer)
        if self.cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.inner.grad_clip)
        if scaler:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, tokens

    def align(self, step: int) -> None:
        """Put the learning-rate schedule at inner step `step` of the run: forward on a resume, join or re-sync;
        back where the workers' last window was dropped (an abandoned round, a stop that ended overlapped workers a
        window ahead), so the schedule follows the outer steps and a checkpoint's position is outer step × H.
        LambdaLR's rate depends on the step alone."""
        if self.scheduler.last_epoch == step:  # a fresh start: no step() before the optimizer's (PyTorch warns)
            return
        self.scheduler.last_epoch = step - 1
        self.scheduler.step()

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]
