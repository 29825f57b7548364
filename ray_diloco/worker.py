"""The training loop of one worker of a region: FSDP2 shards of the model, inner AdamW, and every H steps
an exchange with the region's SyncActor. It runs inside a Ray Train `TorchTrainer`.

The loop knows nothing about Hivemind or other regions: it trains, hands its shards to the SyncActor and
loads back its rows of θ_global. That keeps it a plain `zero_grad → forward → backward → step` loop.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ray_diloco.config import ExperimentConfig
from ray_diloco.inner import build_inner_optimizer
from ray_diloco.model import build_model


def status(line: str) -> None:
    """One status line to the driver's console. Not `print`: Ray Train patches print to tee into its
    logger, which shows every line twice on the driver."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds (the whole tensor when it is not sharded)."""
    data = param.data
    return data.to_local() if isinstance(data, DTensor) else data


def shard_model(model: torch.nn.Module, device: torch.device, world_size: int) -> torch.nn.Module:
    """FSDP2: one `fully_shard` unit per decoder layer, then the root (embeddings, norm, head)."""
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@torch.no_grad()
def load_rows(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        shard = local_shard(param)
        shard.copy_(rows[name].to(device=shard.device, dtype=shard.dtype).reshape(shard.shape))


def shards_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shards as fp32 CPU tensors: what the SyncActor assembles into θ_region."""
    return {name: local_shard(p).detach().float().cpu().clone() for name, p in model.named_parameters()}


def autocast_for(precision: str, device: torch.device):
    """bf16 autocast on GPU by default, fp16 when asked, fp32 on CPU."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext(), None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    return torch.autocast(device_type=device.type, dtype=dtype), scaler


class _Batches:
    """Endless iterator over this worker's Ray Data shard: a new epoch starts when one is used up."""

    def __init__(self, shard, batch_size: int, device: torch.device):
        self.shard, self.batch_size, self.device = shard, batch_size, device
        self.epoch = 0
        self._iter = self._new_epoch()

    def _new_epoch(self):
        return iter(self.shard.iter_torch_batches(batch_size=self.batch_size, dtypes=torch.long,
                                                  device=self.device, drop_last=True))

    def next(self) -> torch.Tensor:
        try:
            return next(self._iter)["input_ids"]
        except StopIteration:
            self.epoch += 1
            self._iter = self._new_epoch()
            return next(self._iter)["input_ids"]


def region_train_loop(loop_config: dict[str, Any]) -> dict[str, Any]:
    """`train_loop_per_worker` of a region's TorchTrainer. Returns this rank's counters."""
    cfg = ExperimentConfig.from_dict(loop_config["experiment"])
    region: str = loop_config["region"]
    sync_actor = loop_config["sync_actor"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    torch.set_num_threads(max(1, int(loop_config.get("threads_per_worker", 1))))

    model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, cfg.run.seed).to(device)
    shard_model(model, device, world_size)
    # θ_global, not the seeded init: a restarted or joining region starts from the run's current state.
    start_outer = ray.get(sync_actor.outer_step.remote())
    load_rows(model, ray.get(sync_actor.global_rows.remote(rank, world_size)))
    optimizer, scheduler = build_inner_optimizer(model.parameters(), cfg.inner, cfg.total_inner_steps)
    for _ in range(start_outer * cfg.outer.inner_steps):
        scheduler.step()  # keep the learning-rate schedule aligned with the run's position
    autocast, scaler = autocast_for(cfg.inner.precision, device)
    batches = _Batches(ray.train.get_dataset_shard("train"), cfg.data.batch_size, device)

    tokens_total, last_sync_seconds, peers = 0, 0.0, len(cfg.regions)
    total_steps = cfg.total_inner_steps
    for outer_step in range(start_outer, cfg.run.outer_steps):
        tokens_this_round = 0
        for inner in range(cfg.outer.inner_steps):
            step = outer_step * cfg.outer.inner_steps + inner
            started = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.inner.grad_accum):
                input_ids = batches.next()
                # Only the last micro-batch reduce-scatters gradients across the region's ranks.
                model.set_requires_gradient_sync(micro == cfg.inner.grad_accum - 1)
                with autocast:
                    loss = model(input_ids=input_ids, labels=input_ids).loss / cfg.inner.grad_accum
                (scaler.scale(loss) if scaler else loss).backward()
                loss_sum += loss.detach()
                tokens_this_round += input_ids.numel()
            if scaler:
                scaler.unscale_(optimizer)
            if cfg.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if world_size > 1:  # the region's mean loss, not rank 0's alone
                dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            seconds = time.perf_counter() - started
            if rank == 0:
                tokens_per_s = cfg.data.batch_size * cfg.data.seq_len * cfg.inner.grad_accum / seconds
                status(f"[{region}] step {step + 1}/{total_steps} | outer {outer_step + 1}/{cfg.run.outer_steps}"
                       f" | loss {loss_sum.item():.4f} | lr {scheduler.get_last_lr()[0]:.2e}"
                       f" | {tokens_per_s:,.0f} tok/s/worker | last sync {last_sync_seconds:.2f}s"
                       f" | peers {peers}")
        sync_started = time.perf_counter()
        rows = ray.get(sync_actor.exchange.remote(outer_step, rank, world_size, shards_of(model),
                                                  tokens_this_round))
        load_rows(model, rows)
        last_sync_seconds = time.perf_counter() - sync_started
        tokens_total += tokens_this_round
        if rank == 0:
            round_info = ray.get(sync_actor.last_round.remote())
            peers = round_info["group_size"]
            status(f"[{region}] outer step {outer_step + 1}/{cfg.run.outer_steps} synced in {last_sync_seconds:.2f}s"
                   f" with {peers} region(s): {', '.join(round_info['peers'])}")
    return {"rank": rank, "tokens": tokens_total, "epochs": batches.epoch}
