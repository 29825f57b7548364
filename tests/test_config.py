"""Configuration: presets round-trip through YAML, bad values give errors that name the field."""

import pytest

from ray_diloco.config import ConfigError, ExperimentConfig
from ray_diloco.presets import PRESETS, get_preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_yaml(name):
    config = get_preset(name)
    again = ExperimentConfig.from_yaml(config.to_yaml())
    assert again == config
    assert again.to_yaml() == config.to_yaml()


def test_opendiloco_shapes_and_hyperparameters():
    small, big = get_preset("150m"), get_preset("1b")
    assert (small.model.hidden_size, small.model.intermediate_size, small.model.num_heads,
            small.model.num_layers) == (1024, 2688, 16, 12)
    assert (big.model.hidden_size, big.model.intermediate_size, big.model.num_heads,
            big.model.num_kv_heads, big.model.num_layers) == (2048, 5632, 32, 4, 22)
    for cfg in (small, big):
        assert cfg.data.seq_len == 1024
        assert (cfg.inner.lr, cfg.inner.weight_decay, cfg.inner.beta1, cfg.inner.beta2) == (4e-4, 0.1, 0.9, 0.95)
        assert (cfg.inner.warmup_steps, cfg.inner.schedule) == (1000, "cosine")
        assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov, cfg.outer.inner_steps) == (0.7, 0.9, True, 500)


@pytest.mark.parametrize(
    "yaml_text, field",
    [
        ("model: {hidden_size: 100, num_heads: 3}", "model.hidden_size"),
        ("model: {num_heads: 4, num_kv_heads: 3}", "model.num_kv_heads"),
        ("data: {seq_len: abc}", "data.seq_len"),
        ("data: {seq_len: 2}", "data.seq_len"),
        ("inner: {precision: fp8}", "inner.precision"),
        ("inner: {grad_accum: 0}", "inner.grad_accum"),
        ("outer: {compression: int4}", "outer.compression"),
        ("outer: {momentum: 1.5}", "outer.momentum"),
        ("outer: {matchmaking_seconds: 10, averaging_timeout: 5}", "outer.averaging_timeout"),
        ("outer: {max_wait_seconds: 0}", "outer.max_wait_seconds"),
        ("outer: {state_download_mbps: 0}", "outer.state_download_mbps"),
        ("run: {mode: async}", "run.mode"),
        ("run: {name: 'has space'}", "run.name"),
        ("run: {mode: ddp, checkpoint_every: 2}", "run.checkpoint_every"),
        ("regions: [{name: us, workers: 0}]", "regions[us].workers"),
        ("regions: [{name: US}]", "regions[].name"),
        ("regions: [{name: us, workers: 3..2}]", "regions[us].workers"),
        ("regions: [{name: us, workers: 0..2}]", "regions[us].workers"),
        ("regions: [{name: us, workers: two}]", "regions[us].workers"),
        ("regions: [{name: us}, {name: us}]", "regions"),
        ("inner: {lrr: 0.1}", "inner"),
        ("bogus: {}", "config"),
    ],
)
def test_bad_value_names_the_field(yaml_text, field):
    with pytest.raises(ConfigError) as error:
        ExperimentConfig.from_yaml(yaml_text)
    assert str(error.value).startswith(field + ":"), str(error.value)


def test_yaml_overrides_only_what_it_names():
    config = ExperimentConfig.from_yaml("outer: {inner_steps: 7}\nregions: [{name: eu, workers: 2}]")
    assert config.outer.inner_steps == 7
    assert config.outer.lr == 0.7  # untouched default
    assert [(r.name, r.workers) for r in config.regions] == [("eu", 2)]


def test_train_flags_reach_the_config():
    from ray_diloco.cli import build_parser, resolve_config

    args = build_parser().parse_args(["train", "--regions", "us,eu", "--checkpoint-every", "3", "--checkpoint-path",
                                      "s3://bucket/ckpt", "--max-failures", "4", "--resume", "--outer-steps", "9",
                                      "--run-name", "again", "--secret-file", "/etc/diloco/run.secret"])
    cfg = resolve_config(args)
    assert [r.name for r in cfg.regions] == ["us", "eu"]
    assert cfg.outer.secret_file == "/etc/diloco/run.secret"  # the path only: the driver reads the bytes
    assert (cfg.run.checkpoint_every, cfg.run.checkpoint_path, cfg.run.max_failures, cfg.run.resume,
            cfg.run.outer_steps) == (3, "s3://bucket/ckpt", 4, True, 9)
    # Everything of the run lives under its name in the shared bucket (runs sharing it stay apart).
    assert cfg.run.checkpoint_root() == "s3://bucket/ckpt/again/checkpoints"


def test_a_worker_range_is_an_elastic_region_of_one_cluster():
    text = "regions: [{name: us, workers: 2..8}, {name: eu, workers: 4}]\nrun: {local_regions: [us]}"
    cfg = ExperimentConfig.from_yaml(text)
    us, eu = cfg.regions
    assert (us.min_workers, us.max_workers, us.elastic) == (2, 8, True)
    assert (eu.min_workers, eu.max_workers, eu.elastic) == (4, 4, False)
    assert ExperimentConfig.from_yaml(cfg.to_yaml()) == cfg  # "2..8" round-trips
    # A peer's declared tokens per round are bounded by the largest region's: 8 workers, one window each.
    window = cfg.outer.inner_steps * cfg.inner.grad_accum * cfg.data.batch_size * cfg.data.seq_len
    assert cfg.max_round_tokens() == 8 * window
    assert ExperimentConfig.from_yaml("regions: [{name: us, workers: 3..3}]").regions[0].workers == 3
    cfg.check_elastic()  # us alone in this cluster


@pytest.mark.parametrize("yaml_text", [
    "regions: [{name: us, workers: 1..2}, {name: eu}]",  # two regions in one cluster
    "regions: [{name: us, workers: 1..2}]\nrun: {mode: ddp}",
])
def test_worker_ranges_are_refused_where_ray_would_count_another_regions_nodes(yaml_text):
    with pytest.raises(ConfigError, match=r"^regions\[\]\.workers: worker ranges \(us\) need one region per"):
        ExperimentConfig.from_yaml(yaml_text).check_elastic()
