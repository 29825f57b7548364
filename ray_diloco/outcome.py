"""What a run reports: the outcome of its training groups and the `summary.json` built from it (field names
are a contract: tools and tests read them), and which region's θ_global the run exports."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ray_diloco.config import ExperimentConfig, RegionConfig
from ray_diloco.data.pipeline import region_file_shares
from ray_diloco.sync import durable
from ray_diloco.sync.outer import state_digest

logger = logging.getLogger(__name__)


def data_parallel_bytes(num_params: int, workers: int, steps: int) -> int:
    """Bytes each worker sends for the gradients of `steps` data-parallel steps, computed from the collective
    sizes: FSDP2's fp32 gradient reduce-scatter plus one parameter all-gather is one ring all-reduce,
    2·(N−1)/N·P·4 bytes, exactly what DDP sends. FSDP2's backward re-gather (a memory saving DDP does
    not need) is left out so the baseline is not inflated."""
    return int(2 * (workers - 1) / workers * num_params * 4) * steps


@dataclass
class TrainingOutcome:
    stats: list[dict]  # per finished group: tokens, bytes, rounds, digest, events
    worker_results: list[dict]  # rank 0's return value per finished group
    finished: list[int]  # indices into the groups
    final_state: dict[str, torch.Tensor]
    curve: list[dict]
    data_counts: dict[str, int]
    # Regions of the run that other drivers ran and that finished it: their final digests (from storage; None:
    # the storage could not be read).
    finished_elsewhere: dict[str, str] | None = field(default_factory=dict)

    def final_outer_step(self) -> int:
        """The outer step the exported θ_global is at (the furthest a finished group got)."""
        return max((w.get("outer_step", 0) for w in self.worker_results), default=0)


def finished_elsewhere(cfg: ExperimentConfig, groups: list[RegionConfig]) -> dict[str, str] | None:
    """The final digests that regions run by other drivers (other clusters) kept in the run's storage; None if
    there are such regions and the storage could not be read (the end is then unchecked: unsettled)."""
    ours = {g.name for g in groups}
    if cfg.run.mode != "diloco" or {r.name for r in cfg.regions} <= ours:
        return {}
    try:
        stored = durable.read_records(cfg.run.states_dir())
    except Exception as error:
        logger.warning("reading the stored state records failed: %r", error)
        return None
    return {region: s.record.digest for region, s in sorted(stored.items())
            if region not in ours and durable.finished(s, cfg.run.outer_steps)}


def eval_curve(cfg: ExperimentConfig, outcome: TrainingOutcome, eval_start: float, eval_loss: float,
               eval_ppl: float) -> list[dict]:
    """Held-out loss against tokens per worker: the start, the evaluator's points, and the end's evaluation where
    the evaluator did not already evaluate that outer step."""
    curve = [{"outer_step": 0, "tokens_per_worker": 0, "eval_loss": eval_start}, *outcome.curve]
    final = outcome.final_outer_step()
    if curve[-1]["outer_step"] != final:
        curve.append({"outer_step": final, "tokens_per_worker": final_tokens_per_worker(cfg, outcome, final),
                      "eval_loss": eval_loss, "eval_perplexity": eval_ppl})
    return curve


def final_tokens_per_worker(cfg: ExperimentConfig, outcome: TrainingOutcome, final: int) -> int:
    """What one worker trained by the end, as the evaluator's points count it: whole windows less those its region
    (the driver's first: it holds the evaluator) trained short, where its SyncActor counted them (DiLoCo)."""
    evaluated = cfg.local_regions()[0].name
    for stats in outcome.stats:
        if stats.get("region") == evaluated and "tokens_per_worker" in stats:
            short = cfg.tokens_per_worker(stats["outer_step"]) - stats["tokens_per_worker"]
            return cfg.tokens_per_worker(final) - short
    return cfg.tokens_per_worker(final)


def canonical_index(stats: list[dict]) -> int:
    """Which finished region's θ_global the run exports: the state every region ends with by the protocol's rule
    (`policy.final_state`: a finished region's state, else the canonical one), each voting with its published
    record (its group size and phase) and the state it holds now."""
    from ray_diloco.sync.policy import final_state, parse_record

    records = [parse_record(s["region"], {"group_size": 0, **(s.get("record") or {}), "outer_step": s["outer_step"],
                                          "digest": s["digest"]}) for s in stats]
    chosen = final_state(records)
    return next(i for i, s in enumerate(stats) if s["region"] == chosen.region)


def baseline_outcome(cfg: ExperimentConfig, group: RegionConfig, rank0: dict,
                     num_params: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """θ and the per-group stats of a ddp or single run (one group, no outer step): rank 0 returned the model."""
    final_state = {name: torch.tensor(a) for name, a in rank0.pop("final_state").items()}
    steps = cfg.total_inner_steps
    sent = data_parallel_bytes(num_params, group.max_workers, steps)
    stats = [{"region": group.name, "tokens": rank0["tokens_per_worker"] * group.max_workers,
              "bytes_sent": sent, "bytes_received": sent, "sync_seconds": 0.0, "rounds": [],
              "digest": state_digest(final_state)}]
    return final_state, stats


def data_files(cfg: ExperimentConfig, groups: list[RegionConfig]) -> dict[str, list[str]] | None:
    """The files each of this driver's groups read (None for a Hugging Face dataset)."""
    regions = cfg.regions if cfg.run.mode == "diloco" else groups
    shares = region_file_shares(cfg.data, len(regions), cfg.run.seed)
    names = [r.name for r in regions]
    return None if shares is None else {g.name: shares[names.index(g.name)] for g in groups}


def agreement(stats: list[dict], exported: str, elsewhere: dict[str, str] | None) -> dict[str, Any]:
    """Whether the run ended on one θ_global: this driver's regions (`stats`) and the regions other drivers ran
    that finished the run (`elsewhere`: region -> final digest, from the run's storage; None: unreadable)."""
    unknown, elsewhere = elsewhere is None, elsewhere or {}
    disagreeing = sorted([s["region"] for s in stats if s["digest"] != exported]
                         + [region for region, digest in elsewhere.items() if digest != exported])
    return {
        "regions_agree": len({s["digest"] for s in stats} | set(elsewhere.values())) == 1,
        # The exported θ_global is the canonical one; regions that finished holding another state are named.
        "exported_digest": exported,
        "disagreeing_regions": disagreeing,
        "global_digest": {s["region"]: s["digest"] for s in stats},
        "finished_elsewhere": elsewhere,
        # Not one θ_global at the end: a region could not take the final state (the CLI then exits non-zero).
        "unsettled": bool(disagreeing) or unknown or any(e["event"] == "unsettled_at_end" for s in stats
                                                         for e in s.get("events", [])),
    }


def bits_per_parameter(stats: list[dict], parameters: int) -> dict[str, float | None]:
    """By region: bits sent on the wire per model parameter, averaged over its rounds with other regions (a round
    alone sends nothing); None for a region that had none (or a baseline)."""
    by_region = {}
    for s in stats:
        shared = [r for r in s.get("rounds", []) if r.get("group_size", 0) > 1]
        sent = sum(r.get("bytes_sent", 0) for r in shared)
        by_region[s["region"]] = round(8 * sent / (len(shared) * parameters), 4) if shared and parameters else None
    return by_region


def build_summary(cfg: ExperimentConfig, groups: list[RegionConfig], outcome: TrainingOutcome, eval_start: float,
                  eval_loss: float, eval_ppl: float, wall: float, num_params: int) -> dict[str, Any]:
    stats, workers = outcome.stats, outcome.worker_results
    mean = lambda values: sum(values) / len(values)  # noqa: E731  (over the finished groups' rank 0)
    return {
        "mode": cfg.run.mode,
        "run": cfg.run.name,
        "regions": [{"name": g.name, "workers": g.workers} for g in groups],
        "inner_steps": cfg.outer.inner_steps,
        "outer_steps": cfg.run.outer_steps,
        "compression": cfg.outer.compression if cfg.run.mode == "diloco" else "none",
        "outer_method": cfg.outer.method if cfg.run.mode == "diloco" else "none",
        "tokens": sum(s["tokens"] for s in stats),
        "eval_loss_at_start": eval_start,
        "eval_loss": eval_loss,
        "eval_perplexity": eval_ppl,
        "comm_bytes_sent": {s["region"]: s["bytes_sent"] for s in stats},
        "comm_bytes_received": {s["region"]: s["bytes_received"] for s in stats},
        "bits_per_parameter_per_round": bits_per_parameter(stats, num_params),
        "comm_bytes_how": "measured on the Hivemind wire" if cfg.run.mode == "diloco"
        else "computed from collective sizes (one fp32 ring all-reduce of gradients per step)",
        "sync_seconds": {s["region"]: round(s["sync_seconds"], 3) for s in stats},
        "wall_seconds": round(wall, 2),
        "tokens_per_second_per_worker": round(mean([w["tokens_per_worker"] / w["train_seconds"] for w in workers]), 1),
        # The median inner step: throughput once streaming runs, without the wait for the first batch.
        "median_step_tokens_per_second_per_worker": round(mean([w["median_step_tokens_per_second"]
                                                                 for w in workers]), 1),
        "compute_utilization": round(mean([1 - (w["sync_wait_seconds"] + w["checkpoint_seconds"]) / w["train_seconds"]
                                           for w in workers]), 4),
        "skipped_records": outcome.data_counts["skipped"],
        "dropped_tail_tokens": outcome.data_counts["tail_dropped"],
        **agreement(stats, state_digest(outcome.final_state), outcome.finished_elsewhere),
        "rounds": {s["region"]: s["rounds"] for s in stats},
        "events": sorted((e for s in stats for e in s.get("events", [])), key=lambda e: e["time"]),
        "eval_curve": eval_curve(cfg, outcome, eval_start, eval_loss, eval_ppl),
        "parameters": num_params,
        # What each group trained on: equal for two runs that saw the same windows (see batches.py).
        "data_fingerprint": {groups[i].name: w["data"] for i, w in zip(outcome.finished, workers)},
        "data_files": data_files(cfg, groups),
        # The Ray nodes that ran each region's training workers, in order of first use (an elastic region's
        # include every node the autoscaler gave it); none in ddp and single mode, which have no SyncActor.
        "worker_nodes": {s["region"]: s["worker_nodes"] for s in stats if "worker_nodes" in s},
        # Rank 0's training loss per inner step (since its last start), per region: loss.png draws it.
        "loss_curve": {groups[i].name: w.get("loss_curve", []) for i, w in zip(outcome.finished, workers)},
        # Rank 0's exchanges: (seconds into its training loop when the exchange returned, seconds it waited).
        "sync_waits": {groups[i].name: w.get("sync_waits", []) for i, w in zip(outcome.finished, workers)},
        # Asked to stop (`ray job stop`, SIGTERM, Ctrl-C): ended early at an outer step with a checkpoint.
        "stopped": any(w.get("stopped") for w in workers),
    }
