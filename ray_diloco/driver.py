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
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from ray_diloco.config import ExperimentConfig, RegionConfig
from ray_diloco.data.eval_set import evaluate_loss, load_eval_windows
from ray_diloco.data.pipeline import DataCounters, build_region_datasets
from ray_diloco.model import build_model, count_parameters, padded_vocab_size
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
    ray.init(num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)), include_dashboard=False)


def region_placement(region: RegionConfig) -> dict[str, str] | None:
    """Pin a region to nodes labelled with its name, when the cluster defines regions."""
    labelled = {node.get("Labels", {}).get(REGION_LABEL) for node in ray.nodes() if node.get("Alive")}
    return {REGION_LABEL: region.name} if region.name in labelled else None


def start_sync_actors(cfg: ExperimentConfig, record_rounds: bool = False) -> list[Any]:
    """The first region's actor bootstraps the DHT; the others join it with its multiaddrs."""
    actors, peers = [], list(cfg.outer.initial_peers)
    config = cfg.to_dict()
    for region in cfg.regions:
        options: dict[str, Any] = {"name": f"diloco-sync-{cfg.run.name}-{region.name}"}
        selector = region_placement(region)
        if selector:
            options["label_selector"] = selector
        actor = SyncActor.options(**options).remote(config, region.name, peers, record_rounds)
        if not peers:
            peers = ray.get(actor.multiaddrs.remote())
        actors.append(actor)
    ray.get([a.outer_step.remote() for a in actors])  # surface start-up errors here
    return actors


def make_trainer(cfg: ExperimentConfig, region: RegionConfig, actor: Any, dataset: Any,
                 storage: Path) -> TorchTrainer:
    selector = region_placement(region)
    resources = {"CPU": region.cpus_per_worker}
    if region.gpus_per_worker:
        resources["GPU"] = region.gpus_per_worker
    return TorchTrainer(
        region_train_loop,
        train_loop_config={"experiment": cfg.to_dict(), "region": region.name, "sync_actor": actor,
                           "threads_per_worker": max(1, int(region.cpus_per_worker))},
        scaling_config=ScalingConfig(num_workers=region.workers, use_gpu=region.gpus_per_worker > 0,
                                     resources_per_worker=resources, label_selector=selector),
        run_config=RunConfig(name=f"{cfg.run.name}-{region.name}", storage_path=str(storage)),
        datasets={"train": dataset},
    )


def evaluate_state(cfg: ExperimentConfig, state: dict | None, windows) -> tuple[float, float]:
    model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, cfg.run.seed)
    if state is not None:
        missing = model.load_state_dict(state, strict=False)
        if missing.missing_keys and not all("lm_head" in k for k in missing.missing_keys):
            raise RuntimeError(f"θ_global lacks parameters: {missing.missing_keys[:5]}")
    return evaluate_loss(model, windows, cfg.data.batch_size)


def run_diloco(cfg: ExperimentConfig, address: str | None = None,
               before_shutdown: Callable[[list[Any]], None] | None = None) -> dict[str, Any]:
    """Train `cfg` with DiLoCo across its regions; returns (and writes) the summary.

    `before_shutdown(actors)` sees the SyncActors after training (tests read recorded rounds there;
    passing it makes the actors record every round's θ_region)."""
    started = time.perf_counter()
    ensure_ray(address, cfg)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    cfg = resolve_vocab(cfg, tokenizer)
    out_dir = Path(cfg.run.output_dir).resolve() / cfg.run.name
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(cfg.to_yaml())

    windows = load_eval_windows(cfg.data, tokenizer)
    eval_start, _ = evaluate_state(cfg, None, windows)
    print(f"[driver] {len(cfg.regions)} region(s) {[r.name for r in cfg.regions]}, "
          f"{count_parameters(build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, 0)):,} "
          f"parameters; held-out loss at start {eval_start:.4f}", flush=True)

    # Progress bars of Ray Data interleave with the status lines; per-step lines say more.
    ray.data.DataContext.get_current().enable_progress_bars = False
    counters = DataCounters.remote()
    datasets = build_region_datasets(cfg.data, len(cfg.regions), cfg.run.seed, counters)
    actors = start_sync_actors(cfg, record_rounds=before_shutdown is not None)
    try:
        trainers = [make_trainer(cfg, region, actor, dataset, out_dir / "ray_train")
                    for region, actor, dataset in zip(cfg.regions, actors, datasets)]
        with ThreadPoolExecutor(max_workers=len(trainers)) as pool:
            # Each fit() blocks until its region finishes; the regions meet only in their SyncActors.
            results = list(pool.map(lambda t: t.fit(), trainers))
        for region, result in zip(cfg.regions, results):
            if result.error:
                raise RuntimeError(f"region {region.name} failed") from result.error
        stats = ray.get([a.stats.remote() for a in actors])
        final_state = ray.get(actors[0].global_state.remote())
        if before_shutdown is not None:
            before_shutdown(actors)
    finally:
        for actor in actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception as error:  # a dead actor must not hide the run's own error
                logger.warning("SyncActor shutdown failed: %s", error)
            ray.kill(actor)

    eval_loss, eval_ppl = evaluate_state(cfg, final_state, windows)
    data_counts = ray.get(counters.get.remote())
    wall = time.perf_counter() - started
    summary = build_summary(cfg, stats, eval_start, eval_loss, eval_ppl, data_counts, wall)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[driver] held-out loss {eval_start:.4f} -> {eval_loss:.4f} (perplexity {eval_ppl:.1f}); "
          f"θ_global identical across regions: {summary['regions_agree']}; "
          f"summary: {out_dir / 'summary.json'}", flush=True)
    return summary


def build_summary(cfg: ExperimentConfig, stats: list[dict], eval_start: float, eval_loss: float,
                  eval_ppl: float, data_counts: dict, wall: float) -> dict[str, Any]:
    tokens = sum(s["tokens"] for s in stats)
    workers = sum(r.workers for r in cfg.regions)
    return {
        "mode": cfg.run.mode,
        "run": cfg.run.name,
        "regions": [{"name": r.name, "workers": r.workers} for r in cfg.regions],
        "inner_steps": cfg.outer.inner_steps,
        "outer_steps": cfg.run.outer_steps,
        "compression": cfg.outer.compression,
        "tokens": tokens,
        "eval_loss_at_start": eval_start,
        "eval_loss": eval_loss,
        "eval_perplexity": eval_ppl,
        "comm_bytes_sent": {s["region"]: s["bytes_sent"] for s in stats},
        "comm_bytes_received": {s["region"]: s["bytes_received"] for s in stats},
        "sync_seconds": {s["region"]: round(s["sync_seconds"], 3) for s in stats},
        "wall_seconds": round(wall, 2),
        "tokens_per_second_per_worker": round(tokens / wall / workers, 1),
        "skipped_records": data_counts["skipped"],
        "dropped_tail_tokens": data_counts["tail_dropped"],
        "regions_agree": len({s["digest"] for s in stats}) == 1,
        "global_digest": {s["region"]: s["digest"] for s in stats},
        "rounds": {s["region"]: s["rounds"] for s in stats},
    }
