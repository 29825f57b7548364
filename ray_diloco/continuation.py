"""What a continued run must keep: the fields in which a run's stored config and a new one may differ, split into
changes that make continuing from its checkpoints impossible and changes that are allowed."""

from __future__ import annotations

from typing import Any

from ray_diloco.config import ExperimentConfig

# What a continued run must keep: the model's shape, the regions (not their worker counts), which windows each
# worker reads in what order (data source, tokenizer, cutting, seed) and where schedules and data positions
# stand (H, grad_accum). Everything else (outer_steps, eval_every, learning rates, timeouts…) may change.
RESUME_FIXED = ("model", "regions", "data.path", "data.hf_dataset", "data.hf_config", "data.tokenizer",
                "data.seq_len", "data.batch_size", "data.docs_per_pack_batch", "inner.grad_accum",
                "outer.inner_steps", "run.mode", "run.seed",
                # A compressed method's state (saved per region) means something only under the same settings.
                "outer.method", "outer.chunk_size", "outer.topk", "outer.quantization_bits", "outer.error_decay")
_NOT_COMPARED = ("run.name", "run.resume", "run.output_dir", "run.checkpoint_path")


def _flatten(cfg: ExperimentConfig) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, values in cfg.to_dict().items():
        # Names shape the run (the data split); worker counts may change: checkpoints re-shard, positions are
        # the region's.
        if section == "regions":
            flat["regions"] = [r["name"] for r in values]
            flat["region_workers"] = [(r["workers"], r["cpus_per_worker"], r["gpus_per_worker"]) for r in values]
        else:
            flat.update({f"{section}.{key}": value for key, value in values.items()})
    return flat


def config_changes(old: ExperimentConfig, new: ExperimentConfig) -> tuple[list[str], list[str]]:
    """(breaking, allowed): the fields, as 'section.field: old -> new', in which `new` differs from a run's
    stored `old` config. A breaking change makes continuing the run from its checkpoints impossible."""
    before, after = _flatten(old), _flatten(new)
    breaking, allowed = [], []
    for key in before.keys() | after.keys():
        if key in _NOT_COMPARED or before.get(key) == after.get(key):
            continue
        fixed = any(key == f or key.startswith(f + ".") for f in RESUME_FIXED)
        (breaking if fixed else allowed).append(f"{key}: {before.get(key)!r} -> {after.get(key)!r}")
    return sorted(breaking), sorted(allowed)
