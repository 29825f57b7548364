"""Worker checkpoints of a region through Ray Train.

At a checkpoint's outer step every rank writes, into a local directory that `ray.train.report` uploads to the
run's storage (`RunConfig(storage_path=…)`: a local path, `s3://…` or `gs://…`):

- its FSDP2 shards of the model and of the inner AdamW state, with `torch.distributed.checkpoint` (one file
  per rank, plus rank 0's metadata; Ray Train merges the ranks' uploads into one directory);
- rank 0 also writes `meta.json`: the outer step, the inner step (the learning-rate schedule's position), the
  worker count that wrote it, whether its AdamW state is fresh (`fresh_inner_state`: written by a group that
  trained no step, so a group that loads it starts AdamW anew and says so), and whether its model is θ_global
  (`holds_theta_global`: not in a checkpoint saved at a hand-in under a preemption notice, before the round that
  makes the state it belongs to; the loader then takes θ_global from the SyncActor).

A group of another size loads it too: `torch.distributed.checkpoint` re-shards the model and AdamW state to the
loading group's mesh (the elastic resize of a region). The data position is the region's, kept by the SyncActor.

The directory is named after the outer step (the step handed in, for one saved at a hand-in under a preemption
notice: `holds_theta_global` false) and a token of this save, and the region's SyncActor — which
commits its own outer checkpoint only after every rank has uploaded — records where it is, so a resumed or
restarted worker loads exactly the worker checkpoint that matches θ_global. The token because one outer step
can be saved twice: a group that restarts (or a run resumed from an older step) trains that step again. Ray
Train keeps its list of reported checkpoints across a run's restarts and deletes the oldest by path; with one
name per step it deleted the second save's directory together with the first's, under a committed outer
checkpoint that still named it (tests/test_faults.py::test_a_step_saved_again_after_a_restart_keeps_its_worker_checkpoint).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ray_diloco.checkpoint import join


META_FILE = "meta.json"


def checkpoint_name(outer_step: int, token: str) -> str:
    return f"checkpoint-outer-{outer_step:06d}-{token}"


def save_token(world_size: int) -> str:
    """A name no earlier save of the run has used, the same on every rank (collective when world_size > 1)."""
    token = [uuid.uuid4().hex[:12]]
    if world_size > 1:
        dist.broadcast_object_list(token, src=0)
    return token[0]


def save_worker_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, experiment_uri: str,
                           outer_step: int, inner_step: int, rank: int, world_size: int,
                           fresh_inner_state: bool = False, holds_theta_global: bool = True) -> str:
    """Every rank of the group calls this (collective); returns where the checkpoint is stored, once every rank's
    part is."""
    local = tempfile.mkdtemp(prefix="diloco-ckpt-")
    try:
        write_worker_checkpoint(model, optimizer, local, outer_step, inner_step, rank, world_size, fresh_inner_state,
                                holds_theta_global)
        name = checkpoint_name(outer_step, save_token(world_size))
        # Uploads this rank's files. Ray Train agrees on the directory with the other ranks before the uploads,
        # not after them: the barrier makes "returned" mean the whole checkpoint is stored, for any rank that
        # then hands its location to the SyncActor to commit.
        ray.train.report({"outer_step": outer_step, "inner_step": inner_step},
                         checkpoint=ray.train.Checkpoint.from_directory(local), checkpoint_dir_name=name)
        if world_size > 1:
            dist.barrier()
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return join(experiment_uri, name)


def write_worker_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str,
                            outer_step: int, inner_step: int, rank: int, world_size: int,
                            fresh_inner_state: bool = False, holds_theta_global: bool = True) -> None:
    """This rank's shards into `directory` (collective), and rank 0's meta: what `load_worker_checkpoint` reads."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    if rank == 0:
        meta = {"outer_step": outer_step, "inner_step": inner_step, "world_size": world_size,
                "fresh_inner_state": fresh_inner_state, "holds_theta_global": holds_theta_global}
        Path(directory, META_FILE).write_text(json.dumps(meta))


KERNEL_FLAGS = ("fused", "foreach")  # how the optimizer steps on this machine, not part of its state


def load_worker_checkpoint(location: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer
                           ) -> dict[str, Any]:
    """Load this rank's model and AdamW shards (collective), re-sharded when the checkpoint was written by
    another worker count; returns its meta (outer step, inner step, world size, fresh_inner_state: then the
    optimizer is left without state, as a fresh one; holds_theta_global: False where the model loaded is the
    workers' at a hand-in, for the caller to replace with θ_global). The optimizer
    keeps its own kernel choice (`fused`, `foreach`: this machine's, see `build_inner_optimizer`), not the
    writer's: the state dict carries them in its param groups, and a checkpoint written on a CPU would make a GPU
    group step unfused."""
    checkpoint = ray.train.Checkpoint(location)
    with checkpoint.as_directory() as directory:
        meta_file = Path(directory, META_FILE)
        if not meta_file.is_file():
            raise FileNotFoundError(f"worker checkpoint {location} has no {META_FILE}: it is incomplete")
        meta = json.loads(meta_file.read_text())
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=directory)
        kernels = [{key: group.get(key) for key in KERNEL_FLAGS} for group in optimizer.param_groups]
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for group, chosen in zip(optimizer.param_groups, kernels):
            group.update(chosen)
    meta.setdefault("fresh_inner_state", False)  # written before the field: by a group that trained
    meta.setdefault("holds_theta_global", True)  # written before the field: after its round
    if meta["fresh_inner_state"]:
        # Nothing to restore, and what was saved is not a fresh AdamW: torch's get_state_dict materialises an empty
        # optimizer's state with a step of lr 0, so the moments say one step was taken, which would damp the first
        # real one. Empty, AdamW starts as with no checkpoint.
        optimizer.state.clear()
    return meta
