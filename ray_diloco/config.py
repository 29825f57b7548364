"""Configuration: one small dataclass per component, validated on construction, YAML in and out.

Every check names the field it rejects and says how to fix it, because a bad value found an hour into a
multi-region run costs the whole run. Presets live in `presets.py`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from ray_diloco import config_fields
from ray_diloco.config_fields import build_section, require as _require
# Torch-free: the CLI checks its inputs before torch is imported.
from ray_diloco.methods.settings import AGGREGATIONS, CODEC_NAMES, DEFAULTS, METHODS, MethodSettings

ConfigError = config_fields.ConfigError  # part of this module's interface: callers catch config.ConfigError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
MODES = ("diloco", "ddp", "single")
_REGION_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")
DEFAULT_OUTPUT_DIR = "~/ray_diloco_results"  # absolute once expanded, like Ray Train's ~/ray_results


def local_path(path: str, base: str | None = None) -> str:
    """`~` expanded; a relative path joined to `base` (default: the working directory)."""
    path = os.path.expanduser(path)
    return os.path.normpath(os.path.join(base or os.getcwd(), path))


def fresh_run_name(prefix: str) -> str:
    """A run name nobody used: prefix + start time + 4 random hex digits (two runs started in the same
    second stay apart)."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


@dataclass(kw_only=True)
class ModelConfig:
    """Shape of the Llama decoder (`transformers.LlamaConfig`)."""

    hidden_size: int = 128
    intermediate_size: int = 344
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None
    """Grouped-query attention heads; None = num_heads (multi-head attention)."""
    vocab_size: int | None = None
    """None = the tokenizer's vocabulary, rounded up to a multiple of 64 (faster matmuls)."""
    tie_embeddings: bool = True
    """Share input embedding and output head: halves the embedding parameters of small models."""
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads"):
            _require(getattr(self, name) > 0, f"model.{name}", f"must be positive, got {getattr(self, name)}")
        _require(
            self.hidden_size % self.num_heads == 0,
            "model.hidden_size",
            f"must be divisible by model.num_heads ({self.hidden_size} % {self.num_heads} != 0)",
        )
        kv = self.num_kv_heads or self.num_heads
        _require(
            kv > 0 and self.num_heads % kv == 0,
            "model.num_kv_heads",
            f"must divide model.num_heads={self.num_heads}, got {self.num_kv_heads}",
        )
        _require(self.vocab_size is None or self.vocab_size > 0, "model.vocab_size", "must be positive or null")


@dataclass(kw_only=True)
class DataConfig:
    """Where the training and held-out text comes from and how it is cut into windows."""

    path: str | None = None
    """None = the embedded C4 sample; else a local dir, a glob, or an s3:// gs:// hf:// dir or glob."""
    hf_dataset: str | None = None
    """A Hugging Face dataset id (e.g. allenai/c4) streamed through `datasets`; exclusive with `path`."""
    hf_config: str | None = "en"
    eval_path: str | None = None
    """Held-out set: a path or glob; None = the embedded held-out shard."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer name or local dir; None = the bundled GPT-2 BPE."""
    seq_len: int = 128
    batch_size: int = 8
    """Windows per micro-batch per worker."""
    docs_per_pack_batch: int = 256
    """Documents tokenized and packed together: the tail of each pack batch (< seq_len tokens) is dropped."""
    eval_windows: int = 64
    read_num_cpus: float = 0.25
    """CPUs each Ray Data read/map task asks for: the train workers hold the rest of the node."""

    def __post_init__(self) -> None:
        _require(self.seq_len >= 8, "data.seq_len", f"must be >= 8, got {self.seq_len}")
        _require(self.batch_size >= 1, "data.batch_size", f"must be >= 1, got {self.batch_size}")
        _require(self.docs_per_pack_batch >= 1, "data.docs_per_pack_batch", "must be >= 1")
        _require(self.eval_windows >= 1, "data.eval_windows", "must be >= 1")
        _require(self.read_num_cpus > 0, "data.read_num_cpus", "must be > 0 (fractions are fine)")
        _require(
            not (self.path and self.hf_dataset),
            "data.path",
            "give either data.path (files) or data.hf_dataset (a streamed dataset id), not both",
        )


@dataclass(kw_only=True)
class InnerOptConfig:
    """AdamW run by every worker for H steps between outer steps."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 10
    schedule: str = "cosine"
    """'cosine' (to min_lr_ratio × lr at the last inner step of the run) or 'constant' after warmup."""
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    grad_accum: int = 1
    precision: str = "auto"
    """'auto' = bf16 on GPU, fp32 on CPU. bf16/fp16: FSDP2 mixed precision (compute in that dtype, fp32 weights,
    gradient reduction and AdamW); 'fp16' adds a GradScaler."""
    compile: bool = False
    """torch.compile each decoder layer before FSDP2 wraps it (as torchtitan does): fewer, fused kernels per step
    on a GPU after a one-off compile at start-up (each worker, each group start); needs a C++ compiler on a CPU,
    where it gains little. The parameters keep their names, so checkpoints are the same either way."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, "inner.lr", f"must be > 0, got {self.lr}")
        _require(self.weight_decay >= 0, "inner.weight_decay", "must be >= 0")
        _require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "inner.beta1", "betas must lie in [0, 1)")
        _require(self.warmup_steps >= 0, "inner.warmup_steps", "must be >= 0")
        _require(self.schedule in ("cosine", "constant"), "inner.schedule", "must be 'cosine' or 'constant'")
        _require(0 <= self.min_lr_ratio <= 1, "inner.min_lr_ratio", "must lie in [0, 1]")
        _require(self.grad_clip >= 0, "inner.grad_clip", "must be >= 0 (0 disables clipping)")
        _require(self.grad_accum >= 1, "inner.grad_accum", f"must be >= 1, got {self.grad_accum}")
        _require(self.precision in PRECISIONS, "inner.precision", f"must be one of {PRECISIONS}")


@dataclass(kw_only=True)
class OuterConfig:
    """DiLoCo's outer loop: Nesterov SGD on the averaged pseudo-gradient, every `inner_steps`."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    inner_steps: int = 20
    """H: inner steps between two outer steps (the DiLoCo paper uses 500)."""
    compression: str = "scaled-fp16"
    """Codec of pseudo-gradients on the wire between regions; accumulation is always fp32. 'scaled-fp16' (a
    power-of-two scale per tensor part: no clamping at ±65504, no flush of tiny values) costs 4 bytes per part."""
    matchmaking_seconds: float = 30.0
    """Hivemind's matchmaking window: once the ready regions ask for a group, how long the group waits for
    all of them to find each other before it goes on with those present."""
    max_wait_seconds: float = 300.0
    """How long a region whose workers are in waits for the other live regions to be ready for the same round
    (readiness records in the DHT) before it averages without them. A region slower by up to this joins every
    round; one slower still (or gone) is counted absent and re-syncs to the others' state."""
    averaging_timeout: float = 120.0
    """Upper bound of one cross-region all-reduce."""
    state_download_mbps: float = 100.0
    """The slowest link, in Mbit/s, over which a region still loads another region's θ_global and momentum (a
    re-sync, a join, the final state): a download may take their size at this rate (at least averaging_timeout),
    then the next holder is tried. (120 s was the bound for any size: ~1.5 GB at 100 Mbit/s, so every re-sync of
    a ~200M-parameter model failed.)"""
    initial_peers: list[str] = field(default_factory=list)
    """Hivemind multiaddrs of a running region: join a run started from another Ray cluster."""
    host: str = "127.0.0.1"
    """Address the Hivemind node listens on; use 0.0.0.0 (and an announced address) across machines."""
    port: int = 0
    """TCP port the Hivemind node listens on (0: any free port). Fix it where a firewall, a NAT forward or an
    announced address must name it."""
    announce: list[str] = field(default_factory=list)
    """Multiaddrs the other regions dial, when they differ from what the node sees on its own interfaces (behind
    NAT: the public address and port forwarded to it, e.g. /ip4/203.0.113.7/tcp/31337, or a relay's address).
    Written to the run's peer files and logged at start."""
    secret_file: str = ""
    """A file holding the run's secret (at least 32 bytes: `openssl rand -hex 32 > run.secret`), the same file in
    every region. Every DHT record is signed with it and checked, and only peers that a signed record names may
    join a round or download the state (ray_diloco.sync.auth). Empty: anyone who reaches a region's port and knows
    the run's name can take part (a warning says so for a run across clusters). Only the path is ever written."""
    overlap: bool = False
    """Run each round while the workers train the next H inner steps; its update reaches them one round late,
    with what they trained meanwhile kept (DiLoCoX's one-step-delay overlap; see ray_diloco.sync.actor). Hides
    a sync of up to H inner steps' time; the last round and checkpointed rounds (run.checkpoint_every) block."""
    sync_actor_cpus: float = 0.5
    """CPUs the Ray scheduler reserves for each region's SyncActor: it mostly waits on the network, and
    runs the outer step (a few fp32 passes over the model) once per round."""
    method: str = "diloco"
    """What a round sends. 'diloco': the whole Δ through `compression`, averaged, Nesterov SGD. 'sparseloco': the
    top-k of an error-feedback buffer per chunk at `quantization_bits` bits (arXiv 2508.15706); 'dct': the top-k
    DCT coefficients of a momentum per chunk (arXiv 2510.03371 / DeMo). Both compressed methods exchange payloads
    (all-gather) and take a plain SGD step: set momentum 0, nesterov false, and lr (their papers: 1.0);
    `--outer-method` does that. See ray_diloco.methods.compressors."""
    chunk_size: int = 0
    """Values per chunk that top-k selects in (0: the method's, sparseloco 4096, dct 64)."""
    topk: int = 0
    """Values (or DCT coefficients) sent per chunk (0: the method's, sparseloco 128 = 3.1 %, dct 2)."""
    quantization_bits: int = 2
    """Bits of each value sparseloco sends (1, 2, 4 or 8)."""
    error_decay: float = 0.95
    """β: sparseloco's error feedback e ← β·e + Δ; dct's momentum m ← β·m + Δ."""
    aggregation: str = "mean"
    """How a round combines the regions' Δ (or payloads): 'mean', token-weighted; 'clipped', each region's
    contribution first scaled down to at most clip_factor × the median of their norms, so that a member sending
    a poisoned Δ moves θ_global by a bounded amount. Every region of a run must use the same (regions that differ
    never share a round). See ray_diloco.sync.aggregation."""
    clip_factor: float = 2.0
    """c of the clipped aggregation: a contribution's norm is cut to c × the median norm."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, "outer.lr", f"must be > 0, got {self.lr}")
        _require(0 <= self.momentum < 1, "outer.momentum", f"must lie in [0, 1), got {self.momentum}")
        _require(
            not self.nesterov or self.momentum > 0, "outer.nesterov", "Nesterov needs outer.momentum > 0"
        )
        _require(self.inner_steps >= 1, "outer.inner_steps", f"must be >= 1, got {self.inner_steps}")
        _require(self.compression in CODEC_NAMES, "outer.compression", f"must be one of {CODEC_NAMES}")
        _require(self.matchmaking_seconds > 0, "outer.matchmaking_seconds", "must be > 0")
        _require(self.max_wait_seconds > 0, "outer.max_wait_seconds", "must be > 0")
        _require(0 <= self.port <= 65535, "outer.port", f"must be a TCP port (0: any free one), got {self.port}")
        _require(self.state_download_mbps > 0, "outer.state_download_mbps", "must be > 0 (Mbit/s)")
        _require(self.sync_actor_cpus >= 0, "outer.sync_actor_cpus", "must be >= 0 (fractions are fine)")
        _require(self.aggregation in AGGREGATIONS, "outer.aggregation",
                 f"must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        _require(self.clip_factor >= 1, "outer.clip_factor",
                 f"must be >= 1 (below 1 the median region itself would be cut), got {self.clip_factor}")
        self._check_method()
        _require(
            self.averaging_timeout > self.matchmaking_seconds,
            "outer.averaging_timeout",
            "must exceed outer.matchmaking_seconds (the round needs time after matchmaking)",
        )

    def _check_method(self) -> None:
        _require(self.method in METHODS, "outer.method", f"must be one of {METHODS}, got {self.method!r}")
        _require(self.chunk_size >= 0 and self.topk >= 0, "outer.chunk_size",
                 "chunk_size and topk must be >= 0 (0: the method's default)")
        _require(self.quantization_bits in (1, 2, 4, 8), "outer.quantization_bits", "must be 1, 2, 4 or 8")
        _require(0 <= self.error_decay < 1, "outer.error_decay", f"must lie in [0, 1), got {self.error_decay}")
        _require(self.method in DEFAULTS or not (self.topk or self.chunk_size), "outer.topk",
                 "only sparseloco and dct select values per chunk: set outer.method (--outer-method) or leave "
                 "topk and chunk_size at 0")
        if self.method in DEFAULTS:
            _require(self.momentum == 0 and not self.nesterov, "outer.momentum",
                     f"{self.method} takes a plain SGD step (its error feedback replaces the outer momentum): set "
                     "outer.momentum 0 and outer.nesterov false, or pass --outer-method, which does")
            chosen = MethodSettings.of(self)
            _require(chosen.chunk_size <= 65536, "outer.chunk_size", f"must be <= 65536, got {chosen.chunk_size}")
            _require(1 <= chosen.topk <= chosen.chunk_size, "outer.topk",
                     f"must lie in [1, chunk_size={chosen.chunk_size}], got {chosen.topk}")

_WORKER_RANGE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")


@dataclass(kw_only=True)
class RegionConfig:
    """One region: one model replica trained by `workers` FSDP2 ranks — a count, or a range "min..max" (an elastic
    region: Ray Train starts and restarts its group with as many workers as the cluster has room for)."""

    name: str
    workers: int | str = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    host: str | None = None
    port: int | None = None
    announce: list[str] | None = None
    """This region's Hivemind listen address, port and announced multiaddrs where they differ from outer.host,
    outer.port and outer.announce (each region's head has its own public address; `--listen-host`, `--port`,
    `--announce` set them for the region a driver runs). A region with a fixed port or announced address keeps
    its SyncActor on the driver's node, the head the address names (`ray_diloco.network`)."""

    def __post_init__(self) -> None:
        self.cpus_per_worker, self.gpus_per_worker = float(self.cpus_per_worker), float(self.gpus_per_worker)
        _require(
            bool(_REGION_NAME.match(self.name)),
            "regions[].name",
            f"{self.name!r} must be lowercase letters, digits and '-', at most 31 characters",
        )
        where = f"regions[{self.name}].workers"
        if isinstance(self.workers, str):
            match = _WORKER_RANGE.match(self.workers)
            _require(match is not None, where, f"{self.workers!r}: give a count (2) or a range min..max (2..8)")
            low, high = int(match.group(1)), int(match.group(2))
            _require(1 <= low <= high, where, f"{self.workers!r}: need 1 <= min <= max")
            self.workers = low if low == high else f"{low}..{high}"
        _require(self.min_workers >= 1, where, f"must be >= 1, got {self.workers}")
        _require(self.cpus_per_worker > 0, f"regions[{self.name}].cpus_per_worker", "must be > 0")
        _require(self.gpus_per_worker >= 0, f"regions[{self.name}].gpus_per_worker", "must be >= 0")
        _require(self.port is None or 0 <= self.port <= 65535, f"regions[{self.name}].port",
                 f"must be a TCP port (0: any free one), got {self.port}")

    @property
    def min_workers(self) -> int:
        return int(str(self.workers).split("..")[0])

    @property
    def max_workers(self) -> int:
        return int(str(self.workers).split("..")[-1])

    @property
    def elastic(self) -> bool:
        return self.min_workers != self.max_workers


@dataclass(kw_only=True)
class RunConfig:
    """The run as a whole: how long, which mode, where the results go."""

    name: str | None = None
    """Run id: scopes Hivemind matchmaking (two runs on one DHT never mix) and names the output. None: a
    fresh name (preset + time) is made at start; to continue a run, name it."""
    mode: str = "diloco"
    outer_steps: int = 5
    """T: number of outer steps; the run trains T × H inner steps per region (ddp and single modes train
    the same T × H steps, with no outer step)."""
    seed: int = 0
    output_dir: str = DEFAULT_OUTPUT_DIR
    """The run writes to output_dir/name/ (summary.json, config.yaml, model/, Ray Train storage): a directory or an
    `s3://`, `gs://` URI (`ray_diloco.results`). A relative path resolves against the directory `ray-diloco`
    started in (in a `ray job submit` job, whose directory is Ray's temporary copy of the working dir: against the
    home directory)."""
    init_from: str | None = None
    """Warm start: a saved model directory (a run's model/ or `ray-diloco export`; local or a URI) instead of the
    seeded init."""
    checkpoint_every: int = 0
    """DiLoCo mode: every this many outer steps each region checkpoints its workers (model and inner AdamW
    shards, schedule and data position, through Ray Train) and its outer state (θ_global, momentum, outer
    step); 0: never."""
    checkpoint_path: str | None = None
    """The bucket every cluster of the run shares: a local directory or an `s3://`, `gs://` URI reachable from
    every node (default: output_dir). Everything the run writes there lives under `<checkpoint_path>/<name>/`
    (`storage()`): its checkpoints (also Ray Train's storage path), peer files, stored states and leases, so
    runs sharing a bucket never see, continue or prune each other's files."""
    resume: bool = False
    """Require continuing from checkpoints (an error if there are none). Without it a run whose name already
    has committed checkpoints for every region continues from them too, as Ray Train does."""
    max_failures: int = 1
    """Restarts of a region's group after a worker dies (Ray Train FailureConfig); it resumes from θ_global."""
    eval_every: int | None = None
    """Evaluate θ_global on the held-out set every this many outer steps, while training goes on (an evaluator
    actor); 0: only at start and end. None (default): the smallest interval whose forward passes cost at most
    `EVAL_COMPUTE_SHARE` (5 %) of the training compute between them (`run_setup.resolve_eval_every`, said at
    start); where even one mid-run evaluation would cost more, only the end's. The end's is always exported too."""
    local_regions: list[str] = field(default_factory=list)
    """DiLoCo mode: the regions this driver runs in its Ray cluster (empty: all). The config lists every region of
    the run; each Ray cluster runs its own (`--local-regions eu`), and the data split, the regions the protocol
    knows and the run id come from the full list, so clusters that share the config read disjoint files."""
    stop_timeout_seconds: float = 900.0
    """After a stop request (`ray job stop`, SIGTERM, Ctrl-C) the driver waits this long for every region to
    finish its round and checkpoint it, then aborts the regions still training. A stop lands mid-window: the
    rest of the window (up to H inner steps), the round's wait for the others (up to outer.max_wait_seconds) and
    its all-reduce (up to outer.averaging_timeout) must fit, so it may not be less than the last two together.
    Ray must wait longer still (RAY_JOB_STOP_WAIT_TIME_S ≥ this + 120 s for the export; checked at start)."""
    log_every: int = 10
    """Inner steps between two reads of the loss and step times (the status lines, loss curve and metrics of
    those steps come together then): one collective and one host sync per this many steps, none per step, so
    logging costs the GPU nothing. A window's last steps are always read before its exchange."""
    resize_check_seconds: float = 60.0
    """An elastic region (`workers: min..max`): how often Ray Train looks for room for more workers while the
    group trains. It then restarts the group, bigger, from the region's last completed outer step (θ_global and
    data position from the SyncActor; the inner AdamW state from that step's worker checkpoint, if one was
    committed, else anew): the inner steps of the unfinished round are trained again."""

    def storage(self) -> str:
        """`<checkpoint_path or output_dir>/<run>`: the run's storage that every cluster of the run shares."""
        base = self.checkpoint_path or self.output_dir
        return f"{base.rstrip('/')}/{self.name}" if "://" in base else os.path.join(local_path(base), self.name)

    def peers_dir(self) -> str:
        """Where each region's SyncActor writes its Hivemind multiaddrs for the others to find."""
        return f"{self.storage()}/peers"

    def states_dir(self) -> str:
        """Where each region keeps its last committed and its final outer state (`ray_diloco.sync.durable`)."""
        return f"{self.storage()}/states"

    def checkpoint_root(self) -> str:
        """`<storage>/checkpoints`: each region's outer checkpoints (`<region>/outer-N`) and the Ray Train runs
        of its workers (`<run>-<region>/`)."""
        return f"{self.storage()}/checkpoints"

    def __post_init__(self) -> None:
        _require(
            self.name is None or bool(re.match(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$", self.name)),
            "run.name",
            f"{self.name!r} must be letters, digits, '-' or '_' (at most 64), it names files and DHT keys",
        )
        _require(self.mode in MODES, "run.mode", f"must be one of {MODES}, got {self.mode!r}")
        _require(self.outer_steps >= 1, "run.outer_steps", f"must be >= 1, got {self.outer_steps}")
        _require(self.checkpoint_every >= 0, "run.checkpoint_every", "must be >= 0 (0 disables checkpoints)")
        _require(self.max_failures >= 0, "run.max_failures", f"must be >= 0, got {self.max_failures}")
        _require(self.eval_every is None or self.eval_every >= 0, "run.eval_every",
                 f"must be >= 0 (or null: chosen for a bounded cost), got {self.eval_every}")
        _require(self.stop_timeout_seconds > 0, "run.stop_timeout_seconds", "must be > 0")
        _require(self.resize_check_seconds > 0, "run.resize_check_seconds", "must be > 0")
        _require(self.log_every >= 1, "run.log_every", f"must be >= 1, got {self.log_every}")
        _require(self.mode == "diloco" or not (self.checkpoint_every or self.resume), "run.checkpoint_every",
                 f"checkpoints and --resume are for DiLoCo runs; mode {self.mode!r} does not checkpoint")


@dataclass(kw_only=True)
class ExperimentConfig:
    """Everything a run needs; `presets.py` builds named ones, YAML files override them."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerOptConfig = field(default_factory=InnerOptConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    regions: list[RegionConfig] = field(default_factory=lambda: [RegionConfig(name="region-0")])
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        _require(len(self.regions) >= 1, "regions", "give at least one region")
        names = [r.name for r in self.regions]
        _require(len(set(names)) == len(names), "regions", f"region names must be unique, got {names}")
        unknown = [name for name in self.run.local_regions if name not in names]
        _require(not unknown, "run.local_regions", f"{unknown} are not regions of the config ({names})")
        _require(len(set(self.run.local_regions)) == len(self.run.local_regions), "run.local_regions",
                 "name each region once")
        _require(self.run.mode == "diloco" or not self.run.local_regions, "run.local_regions",
                 "only DiLoCo runs span Ray clusters; ddp and single run in one")
        from ray_diloco.network import check_network  # a module of its own: the network settings of regions
        from ray_diloco.stopping import check_stop_timeout  # and the rounds a stop may wait for

        check_network(self)
        check_stop_timeout(self)

    def check_elastic(self) -> None:
        """Worker ranges only where one region runs in this Ray cluster (checked once the flags are applied: the
        config lists every region of the run, `--local-regions` picks this cluster's). Ray Train's elastic resize
        counts the free resources of the whole cluster, not of a region's nodes: two elastic groups in one
        cluster would each size themselves on the other's nodes."""
        elastic = [r.name for r in self.regions if r.elastic]
        _require(not elastic or (self.run.mode == "diloco" and len(self.local_regions()) == 1), "regions[].workers",
                 f"worker ranges ({', '.join(elastic)}) need one region per Ray cluster: run each cluster with "
                 "--local-regions <its region> (in one cluster, or in ddp/single mode, give fixed counts)")

    def local_regions(self) -> list[RegionConfig]:
        """The regions this driver runs (all of them unless run.local_regions names some)."""
        wanted = self.run.local_regions
        return [r for r in self.regions if not wanted or r.name in wanted]

    def tokens_per_worker(self, outer_steps: int) -> int:
        """Tokens one worker has trained after `outer_steps` outer steps (H-step blocks in ddp/single)."""
        data = self.data
        return outer_steps * self.outer.inner_steps * data.batch_size * data.seq_len * self.inner.grad_accum

    def max_round_tokens(self) -> int:
        """The most tokens any region of the run trains in one round (its most workers, one window each): the
        bound on a peer's declared weight, so that no member outweighs the largest region."""
        return max(region.max_workers for region in self.regions) * self.tokens_per_worker(1)

    @property
    def total_inner_steps(self) -> int:
        return self.run.outer_steps * self.outer.inner_steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ExperimentConfig":
        _require(isinstance(raw, dict), "config", f"must be a mapping of sections, got {type(raw).__name__}")
        sections = {"model": ModelConfig, "data": DataConfig, "inner": InnerOptConfig,
                    "outer": OuterConfig, "run": RunConfig}
        unknown = set(raw) - set(sections) - {"regions"}
        _require(not unknown, "config", f"unknown section(s) {sorted(unknown)}; known: {sorted(sections)} + regions")
        kwargs: dict[str, Any] = {}
        for key, section_cls in sections.items():
            if key in raw:
                kwargs[key] = build_section(section_cls, raw[key], key)
        if "regions" in raw:
            _require(isinstance(raw["regions"], list), "regions", "must be a list of {name, workers}")
            kwargs["regions"] = [build_section(RegionConfig, r, "regions[]") for r in raw["regions"]]
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, text: str) -> "ExperimentConfig":
        return cls.from_dict(yaml.safe_load(text) or {})
