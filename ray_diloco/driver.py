"""The driver of a multi-region DiLoCo run: starts one SyncActor and one Ray Train group per region,
runs the regions concurrently, evaluates θ_global before and after, and writes `summary.json`.

It runs wherever `ray job submit` or `ray-diloco train` starts it; the work itself happens in actors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
from ray.data import ExecutionOptions
from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from ray_diloco.checkpoint import CheckpointStore, join
from ray_diloco.config import ExperimentConfig, RegionConfig
from ray_diloco.data.eval_set import evaluate_loss, load_eval_windows
from ray_diloco.data.pipeline import DataCounters, build_region_datasets
from ray_diloco.evaluator import Evaluator
from ray_diloco.model import build_model, count_parameters, padded_vocab_size, save_model
from ray_diloco.outer import state_digest
from ray_diloco.sync_actor import SyncActor
from ray_diloco.tokenizer import load_tokenizer
from ray_diloco.worker import region_train_loop

logger = logging.getLogger(__name__)

REGION_LABEL = "ray.io/availability-region"


def resolve_vocab(cfg: ExperimentConfig, tokenizer) -> ExperimentConfig:
    """Fix the model's vocabulary from the tokenizer once, so workers never load the tokenizer to size it."""
    vocab = padded_vocab_size(cfg.model, len(tokenizer))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


def ensure_ray(address: str | None, cfg: ExperimentConfig) -> None:
    if ray.is_initialized():
        return
    if address or os.environ.get("RAY_ADDRESS"):  # `ray job submit` sets RAY_ADDRESS for its driver
        ray.init(address=address)
        return
    # A local cluster: logical CPUs for every worker and SyncActor even on a 2-core machine
    # (they take turns on the cores; torch threads per worker are pinned to 1).
    needed = sum(r.workers * r.cpus_per_worker for r in cfg.regions) + len(cfg.regions) + 2
    # With the dashboard: users watch the run there, and Ray Train's placement-group cleaner needs its
    # State API (without it, it logs "Failed to query Ray Train Controller actor state" over and over).
    context = ray.init(num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)), include_dashboard=True)
    if context.dashboard_url:
        print(f"[driver] Ray dashboard: http://{context.dashboard_url}", flush=True)


def region_placement(region: RegionConfig) -> dict[str, str] | None:
    """Pin a region to nodes labelled with its name, when the cluster defines regions."""
    labelled = {node.get("Labels", {}).get(REGION_LABEL) for node in ray.nodes() if node.get("Alive")}
    return {REGION_LABEL: region.name} if region.name in labelled else None


def resume_step(cfg: ExperimentConfig) -> int | None:
    """The outer step every region of this driver resumes from: the newest one all of them committed (a stop
    can land between two regions' commits; resuming the laggard's step keeps them in lockstep).

    A run started again under the same name continues from its checkpoints, as Ray Train does for a run
    with the same name and storage path (a `ray job submit` retried after a failure picks up where it
    stopped). `--resume` insists: no checkpoint is then an error instead of a fresh start."""
    root = cfg.run.checkpoint_root()
    latest = {r.name: CheckpointStore(join(root, r.name)).latest_step() for r in cfg.regions}
    missing = [name for name, step in latest.items() if step is None]
    if not missing:
        return min(latest.values())
    if cfg.run.resume:
        raise FileNotFoundError(f"--resume: no committed checkpoint for region(s) {missing} under {root}; "
                                "was the run started with --checkpoint-every?")
    if len(missing) < len(latest):
        logger.warning("checkpoints under %s cover only some regions (none for %s): starting the run afresh",
                       root, missing)
    return None


def start_sync_actors(cfg: ExperimentConfig, record_rounds: bool = False, evaluator: Any = None) -> list[Any]:
    """The first region's actor bootstraps the DHT; the others join it with its multiaddrs."""
    actors, peers = [], list(cfg.outer.initial_peers)
    config = cfg.to_dict()
    step = resume_step(cfg) if cfg.run.mode == "diloco" else None
    if step is not None:
        print(f"[driver] continuing run {cfg.run.name} from outer step {step} (checkpoints under "
              f"{cfg.run.checkpoint_root()})", flush=True)
    for region in cfg.regions:
        options: dict[str, Any] = {"name": f"diloco-sync-{cfg.run.name}-{region.name}"}
        selector = region_placement(region)
        if selector:
            options["label_selector"] = selector
        # One evaluator for the run: θ_global is the same in every region.
        actor = SyncActor.options(**options).remote(config, region.name, peers, record_rounds,
                                                    evaluator if not actors else None, step)
        if not peers:
            peers = ray.get(actor.multiaddrs.remote())
        actors.append(actor)
    ray.get([a.outer_step.remote() for a in actors])  # surface start-up errors here
    return actors


def training_groups(cfg: ExperimentConfig) -> list[RegionConfig]:
    """The Ray Train groups of a mode: one per region (diloco), one over all workers (ddp), one worker."""
    if cfg.run.mode == "diloco":
        return list(cfg.regions)
    template = cfg.regions[0]
    if cfg.run.mode == "ddp":
        return [dataclasses.replace(template, name="ddp", workers=sum(r.workers for r in cfg.regions))]
    return [dataclasses.replace(template, name="single", workers=1)]


def deterministic_ingest() -> DataConfig:
    """Each worker's stream in the same order in every run, so a data position is a batch count: Ray Data
    keeps the blocks' order, and splits them across workers without locality hints (those depend on where
    blocks happen to be computed; inside one region the nodes share a fast network)."""
    return DataConfig(execution_options=ExecutionOptions(preserve_order=True), enable_shard_locality=False)


def make_trainer(cfg: ExperimentConfig, group: RegionConfig, actor: Any, evaluator: Any,
                 dataset: Any) -> TorchTrainer:
    selector = region_placement(group)
    resources = {"CPU": group.cpus_per_worker}
    if group.gpus_per_worker:
        resources["GPU"] = group.gpus_per_worker
    experiment = f"{cfg.run.name}-{group.name}"  # the Ray Train run: its name on the dashboard
    return TorchTrainer(
        region_train_loop,
        train_loop_config={"experiment": cfg.to_dict(), "region": group.name, "sync_actor": actor,
                           "evaluator": evaluator, "threads_per_worker": max(1, int(group.cpus_per_worker)),
                           "worker_checkpoints": join(cfg.run.checkpoint_root(), experiment)},
        scaling_config=ScalingConfig(num_workers=group.workers, use_gpu=group.gpus_per_worker > 0,
                                     resources_per_worker=resources, label_selector=selector),
        run_config=RunConfig(name=experiment, storage_path=cfg.run.checkpoint_root(),
                             failure_config=FailureConfig(max_failures=cfg.run.max_failures),
                             # The SyncActor keeps its two newest outer checkpoints; these match them.
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
        datasets={"train": dataset},
        dataset_config=deterministic_ingest(),
    )


def evaluate_state(cfg: ExperimentConfig, model, state: dict | None, windows) -> tuple[float, float]:
    if state is not None:
        model.load_state_dict(state, strict=False)
    return evaluate_loss(model, windows, cfg.data.batch_size)


def data_parallel_bytes(num_params: int, workers: int, steps: int) -> int:
    """Bytes each worker sends for the gradients of `steps` data-parallel steps, computed from the collective
    sizes: FSDP2's fp32 gradient reduce-scatter plus one parameter all-gather is one ring all-reduce,
    2·(N−1)/N·P·4 bytes, exactly what DDP sends. FSDP2's backward re-gather (a memory saving DDP does
    not need) is left out so the baseline is not inflated."""
    return int(2 * (workers - 1) / workers * num_params * 4) * steps


def run_training(cfg: ExperimentConfig, address: str | None = None,
                 before_shutdown: Callable[[list[Any]], None] | None = None) -> dict[str, Any]:
    """Train `cfg` in its mode (diloco, ddp or single); returns (and writes) the summary.

    `before_shutdown(actors)` sees the SyncActors after training (tests read recorded rounds there;
    passing it makes the actors record every round's θ_region)."""
    started = time.perf_counter()
    ensure_ray(address, cfg)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    cfg = resolve_vocab(cfg, tokenizer)
    # Absolute paths before the config reaches actors: their working directories differ from ours.
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(
        cfg.run, output_dir=str(Path(cfg.run.output_dir).resolve()), checkpoint_path=cfg.run.checkpoint_root()))
    out_dir = Path(cfg.run.output_dir) / cfg.run.name
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(cfg.to_yaml())
    groups = training_groups(cfg)

    windows = load_eval_windows(cfg.data, tokenizer)
    model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, cfg.run.seed, cfg.run.init_from)
    num_params = count_parameters(model)
    eval_start, _ = evaluate_state(cfg, model, None, windows)
    print(f"[driver] mode {cfg.run.mode}: {len(groups)} group(s) {[(g.name, g.workers) for g in groups]}, "
          f"{num_params:,} parameters; held-out loss at start {eval_start:.4f}", flush=True)

    # Progress bars of Ray Data interleave with the status lines; per-step lines say more.
    ray.data.DataContext.get_current().enable_progress_bars = False
    counters = DataCounters.remote()
    datasets = build_region_datasets(cfg.data, len(groups), cfg.run.seed, counters)
    evaluator = Evaluator.remote(cfg.to_dict(), windows) if cfg.run.eval_every else None
    actors = start_sync_actors(cfg, record_rounds=before_shutdown is not None, evaluator=evaluator) \
        if cfg.run.mode == "diloco" else [None] * len(groups)
    try:
        trainers = [make_trainer(cfg, group, actor, evaluator, dataset)
                    for group, actor, dataset in zip(groups, actors, datasets)]
        with ThreadPoolExecutor(max_workers=len(trainers)) as pool:
            # Each fit() blocks until its group finishes; regions meet only in their SyncActors.
            outcomes = list(pool.map(_fit, trainers))
        # A region whose group failed for good (after its restarts) has left the run; the others went on.
        finished = [i for i, (_, error) in enumerate(outcomes) if error is None]
        if not finished or (cfg.run.mode != "diloco" and len(finished) < len(groups)):
            failed = [groups[i].name for i in range(len(groups)) if i not in finished]
            raise RuntimeError(f"training failed in {failed}") from next(e for _, e in outcomes if e)
        departures = [{"event": "region_departed", "region": groups[i].name, "time": time.time(),
                       "error": str(outcomes[i][1]).splitlines()[0][:300]}
                      for i in range(len(groups)) if i not in finished]
        for departure in departures:
            logger.warning("region %s left the run: %s", departure["region"], departure["error"])
        results = [outcomes[i][0] for i in finished]
        if cfg.run.mode == "diloco":
            stats = ray.get([actors[i].stats.remote() for i in finished])
            stats[0].setdefault("events", []).extend(departures)
            final_state = ray.get(actors[finished[0]].global_state.remote())
            if before_shutdown is not None:
                before_shutdown(actors)
        else:
            final = results[0].return_value
            final_state = {name: torch.tensor(a) for name, a in final.pop("final_state").items()}
            steps = cfg.total_inner_steps
            stats = [{"region": group.name, "tokens": final["tokens_per_worker"] * group.workers,
                      "bytes_sent": data_parallel_bytes(num_params, group.workers, steps),
                      "bytes_received": data_parallel_bytes(num_params, group.workers, steps),
                      "sync_seconds": 0.0, "rounds": [], "digest": state_digest(final_state)}]
        curve = ray.get(evaluator.get_curve.remote()) if evaluator else []
        data_counts = ray.get(counters.get.remote())
    finally:
        for actor in actors:
            if actor is not None:
                _stop_sync_actor(actor)
        for helper in (evaluator, counters):  # run-scoped actors: a second run in this process starts anew
            if helper is not None:
                ray.kill(helper)

    eval_loss, eval_ppl = evaluate_state(cfg, model, final_state, windows)
    save_model(model, final_state, out_dir / "model", tokenizer)
    wall = time.perf_counter() - started
    summary = build_summary(cfg, groups, stats, eval_start, eval_loss, eval_ppl, data_counts, wall)
    worker_results = [r.return_value for r in results]
    summary["tokens_per_second_per_worker"] = round(
        sum(w["tokens_per_worker"] / w["train_seconds"] for w in worker_results) / len(worker_results), 1)
    # The median inner step: throughput once streaming runs, without the wait for the first batch.
    summary["median_step_tokens_per_second_per_worker"] = round(
        sum(w["median_step_tokens_per_second"] for w in worker_results) / len(worker_results), 1)
    summary["compute_utilization"] = round(
        sum(1 - (w["sync_wait_seconds"] + w["checkpoint_seconds"]) / w["train_seconds"] for w in worker_results)
        / len(worker_results), 4)
    summary["eval_curve"] = [{"outer_step": 0, "tokens_per_worker": 0, "eval_loss": eval_start}, *curve]
    summary["parameters"] = num_params
    # What each group trained on: equal for two runs that saw the same windows (see batches.py).
    summary["data_fingerprint"] = {groups[i].name: results[k].return_value["data"] for k, i in enumerate(finished)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[driver] held-out loss {eval_start:.4f} -> {eval_loss:.4f} (perplexity {eval_ppl:.1f}); "
          f"global model identical across regions: {summary['regions_agree']}; "
          f"summary: {out_dir / 'summary.json'}", flush=True)
    return summary


def _fit(trainer: TorchTrainer) -> tuple[Any, BaseException | None]:
    """Ray Train V2's fit() raises when the group fails for good; a region's failure is an outcome here."""
    try:
        result = trainer.fit()
        return result, result.error
    except Exception as error:
        return None, error


def _stop_sync_actor(actor: Any) -> None:
    try:
        ray.get(actor.shutdown.remote(), timeout=30)
    except Exception as error:  # a dead actor must not hide the run's own error
        logger.warning("SyncActor shutdown failed: %s", error)
    ray.kill(actor)


def build_summary(cfg: ExperimentConfig, groups: list[RegionConfig], stats: list[dict], eval_start: float,
                  eval_loss: float, eval_ppl: float, data_counts: dict, wall: float) -> dict[str, Any]:
    tokens = sum(s["tokens"] for s in stats)
    return {
        "mode": cfg.run.mode,
        "run": cfg.run.name,
        "regions": [{"name": g.name, "workers": g.workers} for g in groups],
        "inner_steps": cfg.outer.inner_steps,
        "outer_steps": cfg.run.outer_steps,
        "compression": cfg.outer.compression if cfg.run.mode == "diloco" else "none",
        "tokens": tokens,
        "eval_loss_at_start": eval_start,
        "eval_loss": eval_loss,
        "eval_perplexity": eval_ppl,
        "comm_bytes_sent": {s["region"]: s["bytes_sent"] for s in stats},
        "comm_bytes_received": {s["region"]: s["bytes_received"] for s in stats},
        "comm_bytes_how": "measured on the Hivemind wire" if cfg.run.mode == "diloco"
        else "computed from collective sizes (one fp32 ring all-reduce of gradients per step)",
        "sync_seconds": {s["region"]: round(s["sync_seconds"], 3) for s in stats},
        "wall_seconds": round(wall, 2),
        "skipped_records": data_counts["skipped"],
        "dropped_tail_tokens": data_counts["tail_dropped"],
        "regions_agree": len({s["digest"] for s in stats}) == 1,
        "global_digest": {s["region"]: s["digest"] for s in stats},
        "rounds": {s["region"]: s["rounds"] for s in stats},
        "events": sorted((e for s in stats for e in s.get("events", [])), key=lambda e: e["time"]),
    }
