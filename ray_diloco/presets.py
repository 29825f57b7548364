"""Named configurations. `tiny-cpu` is the default; `150m` and `1b` use OpenDiLoCo's Llama shapes."""

from __future__ import annotations

from collections.abc import Callable

from ray_diloco.config import (
    ConfigError,
    DataConfig,
    ExperimentConfig,
    InnerOptConfig,
    ModelConfig,
    OuterConfig,
    RegionConfig,
    RunConfig,
)

DEFAULT_PRESET = "tiny-cpu"


def tiny_cpu() -> ExperimentConfig:
    """Small enough that 2 regions x 1 worker on 2 CPU cores show the held-out loss fall in minutes."""
    return ExperimentConfig(
        model=ModelConfig(hidden_size=128, intermediate_size=344, num_layers=2, num_heads=4),
        data=DataConfig(seq_len=128, batch_size=8, eval_windows=64),
        inner=InnerOptConfig(lr=3e-3, warmup_steps=10, weight_decay=0.1, grad_clip=1.0),
        outer=OuterConfig(inner_steps=15),
        regions=[RegionConfig(name="region-a"), RegionConfig(name="region-b")],
        run=RunConfig(outer_steps=4),
    )


def _opendiloco_optimizers() -> tuple[InnerOptConfig, OuterConfig]:
    # OpenDiLoCo / DiLoCo paper hyper-parameters.
    inner = InnerOptConfig(
        lr=4e-4, weight_decay=0.1, beta1=0.9, beta2=0.95, warmup_steps=1000, schedule="cosine",
        grad_clip=1.0, precision="auto",
        compile=True,  # the GPU presets: 1.37x (150m) and 1.43x (1b) faster steps on an H100 (docs/benchmarks.md)
    )
    outer = OuterConfig(
        lr=0.7, momentum=0.9, nesterov=True, inner_steps=500, compression="scaled-fp16",
        matchmaking_seconds=30.0, averaging_timeout=600.0,
    )
    return inner, outer


def llama_150m() -> ExperimentConfig:
    inner, outer = _opendiloco_optimizers()
    return ExperimentConfig(
        model=ModelConfig(hidden_size=1024, intermediate_size=2688, num_layers=12, num_heads=16,
                          tie_embeddings=False),
        data=DataConfig(seq_len=1024, batch_size=16, eval_windows=256, read_num_cpus=1.0),
        inner=inner,
        outer=outer,
        regions=[RegionConfig(name=f"region-{i}", workers=8, cpus_per_worker=8, gpus_per_worker=1)
                 for i in range(2)],
        # A stop waits for the rest of a 500-step window, the others (≤ 300 s) and an all-reduce (≤ 600 s).
        run=RunConfig(outer_steps=88, stop_timeout_seconds=1800.0),
    )


def llama_1b() -> ExperimentConfig:
    inner, outer = _opendiloco_optimizers()
    return ExperimentConfig(
        model=ModelConfig(hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32,
                          num_kv_heads=4, tie_embeddings=False),
        data=DataConfig(seq_len=1024, batch_size=8, eval_windows=256, read_num_cpus=1.0),
        inner=InnerOptConfig(**{**inner.__dict__, "grad_accum": 4}),
        outer=outer,
        regions=[RegionConfig(name=f"region-{i}", workers=8, cpus_per_worker=8, gpus_per_worker=1)
                 for i in range(4)],
        run=RunConfig(outer_steps=100, stop_timeout_seconds=3600.0),
    )


PRESETS: dict[str, Callable[[], ExperimentConfig]] = {
    "tiny-cpu": tiny_cpu,
    "150m": llama_150m,
    "1b": llama_1b,
}


def get_preset(name: str) -> ExperimentConfig:
    if name not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
