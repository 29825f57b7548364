"""Every live training metric of a run, in one place: `ray.util.metrics` that Ray's metrics agent on each
node exports to Prometheus (and from there to Grafana, `cluster/grafana/ray-diloco.json`).

Names start with `ray_diloco_`; Ray exports a custom metric as `ray_<name>`, so Prometheus sees
`ray_ray_diloco_inner_loss`, and a Counter gains `_total` (`ray_ray_diloco_bytes_sent_total`).
`EXPORTED_NAMES` lists the names as Prometheus sees them (the tests hold the Grafana board to it).
Every metric carries the tag `run`; per-region ones `region`; per-worker ones `rank`.

The metric objects are made lazily, in the process that records (a worker, a SyncActor, the evaluator,
the driver), never at import. Recording is a local call into Ray's core worker (no RPC, no `ray.get`,
no device sync): the worker records values it already has on the host.

MFU = model FLOPs per token × tokens/s ÷ the device's peak FLOP/s. FLOPs per token = 6·N + 12·L·d·T
(N: parameters of the matmuls, incl. the output head, not the embedding lookup; L layers, width d,
sequence T: the attention scores and weighted sum; forward + backward, no activation recompute), as in
the PaLM paper's appendix B. The peak is `RAY_DILOCO_PEAK_FLOPS` (FLOP/s per worker's device) when set,
else a table of dense bf16 peaks for known GPUs, else on CPU `DEFAULT_CPU_PEAK_FLOPS` = 1e11 (100 GFLOP/s:
a few cores' fp32 FMA units; set the variable for your CPU to make the number meaningful).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "ray_diloco_"
PEAK_FLOPS_ENV_VAR = "RAY_DILOCO_PEAK_FLOPS"
DEFAULT_CPU_PEAK_FLOPS = 1e11
# Dense bf16 tensor-core peaks (FLOP/s) by a substring of `torch.cuda.get_device_name()`.
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}

# name -> (kind, description (ASCII: Ray refuses other text), tag keys). Gauges hold the last value;
# counters only grow.
_RUN, _REGION, _RANK = ("run",), ("run", "region"), ("run", "region", "rank")
DEFINITIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # Workers (rank 0 for the region's values: its loss is the group's mean).
    "inner_loss": ("gauge", "Training loss of the last inner step (the region's mean over its workers)", _REGION),
    "learning_rate": ("gauge", "Inner learning rate after the last inner step", _REGION),
    "tokens_per_second": ("gauge", "Tokens per second of this worker's last inner step", _RANK),
    "inner_step_seconds": ("gauge", "Seconds of this worker's last inner step", _RANK),
    "mfu": ("gauge", "Model FLOPs utilization of this worker's last inner step (0..1)", _RANK),
    "tokens": ("counter", "Tokens this worker trained on", _RANK),
    "compute_utilization": ("gauge", "Share of the training loop not spent on outer steps or checkpoints", _RANK),
    # SyncActors.
    "outer_step": ("gauge", "Outer steps the region's SyncActor has applied", _REGION),
    "outer_round_seconds": ("gauge", "Seconds of the last outer round by phase: wait_for_shards (first to last "
                            "rank in), wait_for_peers (rendezvous with the other regions, re-sync, matchmaking), "
                            "all_reduce (the Hivemind transfer and decode), apply (delta, outer step, publish)",
                            _REGION + ("phase",)),
    "round_duration_seconds": ("histogram", "Seconds of each outer round, first rank in to applied (every round "
                               "counted, however short)", _REGION),
    "region_workers": ("gauge", "Workers in the region's training group now (an elastic region resizes)", _REGION),
    "connected_peers": ("gauge", "Hivemind peers this region's node is connected to (sampled each round)", _REGION),
    "checkpoint_seconds": ("gauge", "Seconds the region's last checkpoint took (workers' upload and the commit)",
                           _REGION),
    "last_checkpoint_step": ("gauge", "Outer step of the region's last committed checkpoint", _REGION),
    "bytes_sent": ("counter", "Bytes this region sent to other regions (Hivemind wire)", _REGION),
    "bytes_received": ("counter", "Bytes this region received from other regions (Hivemind wire)", _REGION),
    "round_regions": ("gauge", "Regions in this region's last outer round", _REGION),
    "bits_per_parameter": ("gauge", "Bits this region sent per model parameter in its last outer round (Hivemind "
                           "wire; outer.method sets how few)", _REGION),
    "events": ("counter", "Membership and fault events (sync_actor_started, worker_restart, resync, "
               "region_joined, region_departed, ...)", _REGION + ("event",)),
    # Evaluator and driver.
    "eval_loss": ("gauge", "Held-out loss of theta_global at the last evaluated outer step", _RUN),
    "eval_perplexity": ("gauge", "Held-out perplexity of theta_global at the last evaluated outer step", _RUN),
    "eval_outer_step": ("gauge", "Outer step of the last held-out evaluation", _RUN),
    "skipped_records": ("gauge", "Malformed input records skipped by the data pipeline (whole run)", _RUN),
}


# Bucket bounds of the round-time histogram: a loopback round takes about a second, a WAN round of a large model
# minutes (ray.util.metrics needs them fixed up front).
ROUND_SECONDS_BOUNDARIES = [0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800]


def exported_names(name: str) -> list[str]:
    """The names Prometheus sees for metric `name` (without prefix): Ray adds `ray_`, counters `_total`,
    histograms `_bucket`, `_sum` and `_count`."""
    kind, base = DEFINITIONS[name][0], f"ray_{PREFIX}{name}"
    if kind == "histogram":
        return [f"{base}_bucket", f"{base}_sum", f"{base}_count"]
    return [base + ("_total" if kind == "counter" else "")]


EXPORTED_NAMES = {exported for name in DEFINITIONS for exported in exported_names(name)}

_metrics: dict[str, Any] = {}
_lock = threading.Lock()


def _metric(name: str):
    """The metric object, made on first use in this process."""
    metric = _metrics.get(name)
    if metric is None:
        from ray.util import metrics

        with _lock:
            metric = _metrics.get(name)
            if metric is None:
                kind, description, tag_keys = DEFINITIONS[name]
                if kind == "histogram":
                    metric = metrics.Histogram(PREFIX + name, description=description, tag_keys=tag_keys,
                                               boundaries=ROUND_SECONDS_BOUNDARIES)
                else:
                    cls = metrics.Counter if kind == "counter" else metrics.Gauge
                    metric = cls(PREFIX + name, description=description, tag_keys=tag_keys)
                _metrics[name] = metric
    return metric


def _set(name: str, value: float, **tags: Any) -> None:
    _metric(name).set(float(value), tags={k: str(v) for k, v in tags.items()})


def _inc(name: str, value: float, **tags: Any) -> None:
    if value > 0:  # Ray refuses 0
        _metric(name).inc(float(value), tags={k: str(v) for k, v in tags.items()})


# -- MFU ---------------------------------------------------------------------------------------------------
def flops_per_token(model_cfg, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N (matmul parameters, incl. the output head) + 12·L·d·T (attention)."""
    d, L = model_cfg.hidden_size, model_cfg.num_layers
    kv = (model_cfg.num_kv_heads or model_cfg.num_heads) * (d // model_cfg.num_heads)
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * model_cfg.intermediate_size  # q, o; k, v; gate, up, down
    return 6.0 * (L * per_layer + d * vocab_size) + 12.0 * L * d * seq_len


def peak_flops(device_type: str, device_name: str = "") -> float:
    """The peak FLOP/s of one worker's device: RAY_DILOCO_PEAK_FLOPS, else a known GPU, else the CPU default."""
    value = os.environ.get(PEAK_FLOPS_ENV_VAR)
    if value:
        return float(value)
    if device_type == "cuda":
        for key, peak in GPU_PEAK_FLOPS.items():
            if key in device_name:
                return peak
    return DEFAULT_CPU_PEAK_FLOPS


# -- what each process records -----------------------------------------------------------------------------
def record_inner_step(run: str, region: str, rank: int, seconds: float, tokens: int, flops_token: float,
                      peak: float, loss: float | None = None, lr: float | None = None) -> None:
    """One inner step of one worker; `loss`/`lr` from rank 0 only (the region's values)."""
    rate = tokens / seconds if seconds > 0 else 0.0
    _set("tokens_per_second", rate, run=run, region=region, rank=rank)
    _set("inner_step_seconds", seconds, run=run, region=region, rank=rank)
    _set("mfu", flops_token * rate / peak, run=run, region=region, rank=rank)
    _inc("tokens", tokens, run=run, region=region, rank=rank)
    if loss is not None:
        _set("inner_loss", loss, run=run, region=region)
    if lr is not None:
        _set("learning_rate", lr, run=run, region=region)


def record_compute_utilization(run: str, region: str, rank: int, utilization: float) -> None:
    _set("compute_utilization", utilization, run=run, region=region, rank=rank)


ROUND_PHASES = ("wait_for_shards", "wait_for_peers", "all_reduce", "apply")


def record_round(run: str, region: str, outer_step: int, group_size: int, phases: dict[str, float],
                 bytes_sent: int, bytes_received: int, connected_peers: int | None = None,
                 parameters: int | None = None) -> None:
    """One outer round of a region's SyncActor (`outer_step`: the step reached; `phases`: seconds by
    ROUND_PHASES; `parameters`: the model's, for bits per parameter)."""
    if parameters:
        _set("bits_per_parameter", 8 * bytes_sent / parameters, run=run, region=region)
    _set("outer_step", outer_step, run=run, region=region)
    _set("round_regions", group_size, run=run, region=region)
    for phase in ROUND_PHASES:
        _set("outer_round_seconds", phases.get(phase, 0.0), run=run, region=region, phase=phase)
    _metric("round_duration_seconds").observe(sum(phases.values()), tags={"run": run, "region": region})
    _inc("bytes_sent", bytes_sent, run=run, region=region)
    _inc("bytes_received", bytes_received, run=run, region=region)
    if connected_peers is not None:
        _set("connected_peers", connected_peers, run=run, region=region)


def record_region_workers(run: str, region: str, workers: int) -> None:
    _set("region_workers", workers, run=run, region=region)


def record_checkpoint(run: str, region: str, outer_step: int | None = None, seconds: float | None = None) -> None:
    """A committed checkpoint (the SyncActor: its step) or the time one took (rank 0 of the workers)."""
    if outer_step is not None:
        _set("last_checkpoint_step", outer_step, run=run, region=region)
    if seconds is not None:
        _set("checkpoint_seconds", seconds, run=run, region=region)


def record_outer_step(run: str, region: str, outer_step: int) -> None:
    """The outer step a SyncActor holds outside a round (start, resume, re-sync, join)."""
    _set("outer_step", outer_step, run=run, region=region)


def record_event(run: str, region: str, event: str) -> None:
    _inc("events", 1, run=run, region=region, event=event)


def record_eval(run: str, outer_step: int, loss: float, perplexity: float) -> None:
    _set("eval_loss", loss, run=run)
    _set("eval_perplexity", perplexity, run=run)
    _set("eval_outer_step", outer_step, run=run)


def record_skipped_records(run: str, skipped: int) -> None:
    _set("skipped_records", skipped, run=run)


def safely(record, *args: Any, **kwargs: Any) -> None:
    """Call a `record_*` function; a metrics failure (no Ray in this process, a unit test) never stops
    training."""
    global _warned
    try:
        record(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 — observability must not take the run down
        if not _warned:
            _warned = True
            logger.warning("ray_diloco metrics not recorded in this process: %r", error)


_warned = False
