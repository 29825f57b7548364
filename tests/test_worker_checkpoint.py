"""A worker checkpoint written by a group of 2 loads into a group of 1 (an elastic region's scale-in), on real gloo
ranks with FSDP2: `torch.distributed.checkpoint` re-shards the model and the inner AdamW state to the loading
group's mesh, and the one worker ends with exactly the parameters and moments the two held between them.

The end-to-end resize runs in tests/test_elastic.py, where whether the group restarts from a checkpoint or between
a round and its checkpoint depends on when the preemption falls; this test is the re-sharding without the timing.
"""

import dataclasses
import functools
import io

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from conftest import SameBatch, run_gloo_ranks

from ray_diloco.inner_step import InnerStep, local_shard, shard_model
from ray_diloco.model import build_model
from ray_diloco.presets import tiny_cpu
from ray_diloco.sharding import to_wire
from ray_diloco.worker import restore_from
from ray_diloco.worker_checkpoint import load_worker_checkpoint, write_worker_checkpoint

VOCAB = 320


def _group(world: int, port: int, rank: int):
    """A small tiny-preset model and its inner step, sharded over `world` gloo ranks."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return _model_and_step(world)


def _model_and_step(world: int):
    """The model and inner step of `_group`, in a process group already formed."""
    base = tiny_cpu()
    cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, hidden_size=32, intermediate_size=64,
                                                              num_layers=2, num_heads=2),
                              inner=dataclasses.replace(base.inner, precision="fp32", warmup_steps=0))
    model = shard_model(build_model(cfg.model, VOCAB, 16, seed=0), torch.device("cpu"), world, "fp32")
    return model, InnerStep(model, cfg, torch.device("cpu"), 0)


def _full_state(model, optimizer) -> bytes:
    """Every parameter and AdamW moment, unsharded, serialized (collective; rank 0's is the whole, the other
    ranks' empty). Bytes, not tensors: a tensor on a multiprocessing queue is shared memory that the rank's exit
    would take away before the test reads it."""
    model_state, optim_state = get_state_dict(model, optimizer,
                                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    buffer = io.BytesIO()
    torch.save({"model": model_state, "optim": optim_state.get("state", {})}, buffer)
    return buffer.getvalue()


def _read(state: bytes) -> dict:
    return torch.load(io.BytesIO(state), weights_only=True)


def _write(directory: str, rank: int, port: int, results) -> None:
    model, step = _group(2, port, rank)
    batch = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(3):  # trained moments: a load that left the optimizer fresh would show zeros
        step(SameBatch(batch))
    write_worker_checkpoint(model, step.optimizer, directory, outer_step=5, inner_step=3, rank=rank, world_size=2)
    full = _full_state(model, step.optimizer)
    if rank == 0:
        results.put(full)
    dist.destroy_process_group()


def _load(directory: str, rank: int, port: int, results) -> None:
    model, step = _group(1, port, rank)
    meta = load_worker_checkpoint(directory, model, step.optimizer)
    results.put((meta, _full_state(model, step.optimizer)))
    dist.destroy_process_group()


def test_a_checkpoint_written_by_two_workers_loads_into_one_resharded(tmp_path):
    directory = str(tmp_path / "checkpoint")
    (written,) = run_gloo_ranks(functools.partial(_write, directory), world=2, rows=1)
    ((meta, loaded),) = run_gloo_ranks(functools.partial(_load, directory), world=1, rows=1)
    written, loaded = _read(written), _read(loaded)

    assert meta == {"outer_step": 5, "inner_step": 3, "world_size": 2, "fresh_inner_state": False,
                    "holds_theta_global": True}
    assert written["model"].keys() == loaded["model"].keys()
    for name, value in written["model"].items():
        assert torch.equal(loaded["model"][name], value), name
    assert written["optim"].keys() == loaded["optim"].keys() and written["optim"]
    for name, state in written["optim"].items():
        assert state["exp_avg"].abs().sum() > 0, name  # trained moments, not a fresh optimizer's zeros
        for key, value in state.items():
            assert torch.equal(loaded["optim"][name][key], value), (name, key)


def _untrained_round_trips(directory: str, rank: int, port: int, results) -> None:
    """For each marking: a checkpoint written by a group that took no step, loaded into another fresh group; puts
    (fresh_inner_state as loaded, the loaded optimizer's step counts)."""
    _group(1, port, rank)
    for fresh in (False, True):
        model, step = _model_and_step(1)
        path = f"{directory}/fresh-{fresh}"
        write_worker_checkpoint(model, step.optimizer, path, outer_step=2, inner_step=0, rank=rank, world_size=1,
                                fresh_inner_state=fresh)
        model, step = _model_and_step(1)
        meta = load_worker_checkpoint(path, model, step.optimizer)
        results.put((meta["fresh_inner_state"], sorted({float(s["step"]) for s in step.optimizer.state.values()})))
    dist.destroy_process_group()


def test_a_checkpoint_of_a_group_that_trained_nothing_loads_as_a_fresh_adamw(tmp_path):
    """A group restarted after its region's stop checkpoints before any step (worker.region_train_loop). Saving
    takes a step of lr 0 (torch's get_state_dict materialises an empty optimizer's state): loaded as it is, AdamW
    would count one step already taken. Marked fresh, it loads with no state, as a group with no checkpoint starts."""
    loaded = run_gloo_ranks(functools.partial(_untrained_round_trips, str(tmp_path)), world=1, rows=2)
    assert loaded == [(False, [1.0]), (True, [])]  # unmarked: what the load would have restored


def _hand_in_restores(directory: str, rank: int, port: int, results) -> None:
    """A group trains 3 steps and saves at its hand-in of outer step 1 (H = 3; the model θ_local); θ_global of the
    step its round reached differs. For the round reaching step 2, then (re-synced) step 3, a new group restores the
    SyncActor's point with that checkpoint: puts (restored, the new model's parameters equal θ_global, its AdamW state
    equals the saved one, the schedule's position); then for a point of step 0, before the hand-in: the error."""
    model, step = _group(1, port, rank)
    batch = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    for _ in range(3):
        step(SameBatch(batch))
    write_worker_checkpoint(model, step.optimizer, directory, outer_step=1, inner_step=6, rank=rank, world_size=1,
                            holds_theta_global=False)
    saved = _read(_full_state(model, step.optimizer))
    theta_global = {name: local_shard(p).detach().clone() + 0.25 for name, p in model.named_parameters()}
    for reached in (2, 3, 0):
        model, step = _model_and_step(1)
        point = {"outer_step": reached, "rows": to_wire(theta_global), "worker_checkpoint": directory}
        try:
            restored = restore_from(point, model, step, inner_steps=3)
        except RuntimeError as error:
            results.put(str(error))
            continue
        loaded = _read(_full_state(model, step.optimizer))
        results.put((restored, all(torch.equal(local_shard(p).detach(), theta_global[name])
                                   for name, p in model.named_parameters()),
                     all(torch.equal(loaded["optim"][name][key], value) for name, state in saved["optim"].items()
                         for key, value in state.items()),
                     step.scheduler.last_epoch))
    dist.destroy_process_group()


def test_a_hand_in_checkpoint_restores_adamw_with_theta_global_from_the_sync_actor(tmp_path):
    """The workers' checkpoint saved as they handed in under a preemption notice (worker.save_at_hand_in) holds their
    own trained θ, not θ_global of the step the round reached: the restarted group takes θ_global from the
    SyncActor's point, AdamW from the checkpoint and the schedule from the step reached (a re-sync's later one too).
    (Checked as a θ_global one, it was refused as an inconsistent store.) A point older than the checkpoint is
    refused."""
    results = run_gloo_ranks(functools.partial(_hand_in_restores, str(tmp_path / "hand-in")), world=1, rows=3)
    assert results[:2] == [(True, True, True, 6), (True, True, True, 9)]
    assert "does not hold θ_global of outer step 0" in results[2] and "inconsistent" in results[2]
