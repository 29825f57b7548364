"""Every path a run is given may be an s3:// URI, checked against a real S3 API server (moto's server mode, a
subprocess on 127.0.0.1, `tests/s3_server.py`) reached through the standard AWS environment (AWS_ENDPOINT_URL):
- pyarrow finds the server from AWS_ENDPOINT_URL alone (what the code relies on instead of passing it);
- --config is read from the bucket; a missing object, a missing bucket and an unwritable --output-dir or
  --checkpoint-path are one line naming the flag, exit 2, before Ray;
- data files are listed (directory, glob) and their json.gz records read; outer checkpoints are saved, loaded
  and pruned in the bucket; --init-from loads a model directory from it; results written under an s3:// output
  directory land there;
- one real 2-region `ray-diloco train` with --config, --data, --eval-data, --checkpoint-path and --output-dir all
  in the bucket finishes, and its results and committed checkpoints are there (and load back).
"""

import dataclasses
import gc
import json
import time

import pyarrow.fs as pafs
import pytest
import ray
import torch
import yaml

from conftest import TEST_DATA, Driver, driver_env
from s3_server import SHADOWING_VARIABLES, S3Server, free_port
from ray_diloco.cli import build_parser, main, resolve_config
from ray_diloco.config import ConfigError, DataConfig, ExperimentConfig
from ray_diloco.data.files import embedded_train_dir, list_data_files, resolve_filesystem
from ray_diloco.data.preflight import check_data
from ray_diloco.model import parameter_state
from ray_diloco.sync.outer import state_digest
from ray_diloco.uris import join


@pytest.fixture(scope="module")
def s3_server():
    server = S3Server().start()
    yield server
    server.stop()
    # Arrow requires FinalizeS3 before the process ends; its own atexit hook runs during interpreter shutdown,
    # with other threads still alive, and a pytest process ended in a segmentation fault (exit 139) after
    # every test had passed. This module is the only one using S3 in the pytest process, so it shuts the AWS
    # SDK down here, once its clients are gone. A later in-process S3 call would raise, not pass silently.
    gc.collect()
    pafs.finalize_s3()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The server, with this process's AWS environment pointing at it (subprocesses inherit it)."""
    for name in SHADOWING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    return s3_server


def keys(server: S3Server, uri: str) -> set[str]:
    """Every object under `uri`, relative to it."""
    inner = uri.split("://", 1)[1].rstrip("/")
    infos = server.filesystem().get_file_info(pafs.FileSelector(inner, recursive=True, allow_not_found=True))
    return {info.path[len(inner) + 1:] for info in infos if info.is_file}


def put(server: S3Server, uri: str, payload: bytes) -> None:
    with server.filesystem().open_output_stream(uri.split("://", 1)[1]) as stream:
        stream.write(payload)


def upload_sample(server: S3Server, uri: str) -> None:
    """The embedded C4 sample (8 training shards, 1 held-out shard) under `uri`, by the tests' own client."""
    pafs.copy_files(embedded_train_dir(), uri.split("://", 1)[1], destination_filesystem=server.filesystem())


def test_pyarrow_finds_the_server_from_aws_endpoint_url_alone(s3):
    bucket = s3.new_bucket()
    put(s3, f"{bucket}/hello.txt", b"hi")
    fs, path = resolve_filesystem(f"{bucket}/hello.txt")  # no endpoint passed: the environment names it
    with fs.open_input_file(path) as handle:
        assert handle.read() == b"hi"


def test_config_is_read_from_the_bucket(s3):
    bucket = s3.new_bucket()
    put(s3, f"{bucket}/run.yaml", yaml.safe_dump({"outer": {"inner_steps": 7}, "run": {"name": "from-s3"}}).encode())
    cfg = resolve_config(build_parser().parse_args(["train", "--config", f"{bucket}/run.yaml"]))
    assert (cfg.outer.inner_steps, cfg.run.name) == (7, "from-s3")


@pytest.mark.parametrize("argv, flag", [
    (["--config", "{bucket}/missing.yaml"], "--config: no such file"),
    (["--config", "s3://no-such-bucket/run.yaml"], "--config: no such file"),
    (["--output-dir", "s3://no-such-bucket/runs"], "--output-dir: cannot write to s3://no-such-bucket/runs"),
    (["--checkpoint-path", "s3://no-such-bucket/ckpt"], "--checkpoint-path: cannot write to s3://no-such-bucket"),
], ids=["config-object", "config-bucket", "output-dir", "checkpoint-path"])
def test_a_missing_object_or_bucket_is_one_line_naming_the_flag_before_ray(s3, tmp_path, capsys, argv, flag):
    bucket = s3.new_bucket()
    argv = [a.format(bucket=bucket) for a in argv]
    assert main(["train", "--run-name", "r", "--output-dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"ray-diloco: error: {flag}"), err
    assert not ray.is_initialized()


@pytest.mark.parametrize("argv, flag", [
    (["--config", "s3://bucket/run.yaml"], "--config: cannot read s3://bucket/run.yaml"),
    (["--resume", "--checkpoint-path", "s3://bucket/ckpt"], "--checkpoint-path: cannot read s3://bucket/ckpt/r"),
], ids=["config", "resume"])
def test_an_unreachable_endpoint_is_one_line_too(s3, monkeypatch, capsys, argv, flag):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert main(["train", "--run-name", "r", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"ray-diloco: error: {flag}"), err


def test_data_in_the_bucket_is_listed_globbed_and_read(s3):
    bucket = s3.new_bucket()
    upload_sample(s3, f"{bucket}/c4")
    listed = list_data_files(f"{bucket}/c4")  # a directory: its c4-train shards, not the held-out one
    assert listed == [f"{bucket}/c4/c4-train.{i:05d}-of-00008.json.gz" for i in range(8)]
    assert list_data_files(f"{bucket}/c4/c4-train.0000[0-2]-*.json.gz") == listed[:3]
    shares = check_data(DataConfig(path=f"{bucket}/c4/c4-train.*.json.gz",
                                   eval_path=f"{bucket}/c4/c4-validation.*.json.gz"), 2, 0)
    assert sorted(sum(shares, [])) == listed  # and the first records of each region's first file parsed
    with pytest.raises(ConfigError, match="^--data: no data files match"):
        check_data(DataConfig(path=f"{bucket}/nothing/*.json.gz"), 2, 0)


def test_outer_checkpoints_in_the_bucket_are_saved_loaded_and_pruned(s3):
    from ray_diloco.checkpoint import MARKER, CheckpointStore, OuterCheckpoint

    root = f"{s3.new_bucket()}/ckpt/region-a"
    store = CheckpointStore(root, keep=2)
    for step in (1, 2, 3):
        store.save(OuterCheckpoint(outer_step=step, theta={"w": torch.full((3,), float(step))},
                                   momentum={"w": torch.zeros(3)}, config_yaml=f"step: {step}\n"))
    assert store.steps() == [2, 3]
    assert not any(k.startswith("outer-000001/") for k in keys(s3, root))  # pruned, not only hidden
    put(s3, f"{root}/outer-000004/outer_state.pt", b"half written")  # no marker: not a checkpoint
    loaded = store.load()
    assert loaded.outer_step == 3 and torch.equal(loaded.theta["w"], torch.full((3,), 3.0))
    assert loaded.config_yaml == "step: 3\n" and f"outer-000003/{MARKER}" in keys(s3, root)


def test_init_from_loads_a_model_directory_from_the_bucket(s3, tmp_path):
    from ray_diloco.model import build_model, save_model
    from ray_diloco.presets import tiny_cpu
    from ray_diloco.run_setup import check_init_from, require_saved_model
    from ray_diloco.tokenizer import load_tokenizer

    cfg = tiny_cpu()
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=(len(tokenizer) + 63) // 64 * 64))
    saved = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, seed=1)
    save_model(saved, parameter_state(saved), tmp_path / "model", tokenizer)
    uri = f"{s3.new_bucket()}/runs/first/model"
    pafs.copy_files(str(tmp_path / "model"), uri[len("s3://"):], destination_filesystem=s3.filesystem())

    require_saved_model(uri)
    loaded = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, seed=2, init_from=uri)
    assert all(torch.equal(a, b) for a, b in zip(parameter_state(saved).values(), parameter_state(loaded).values()))
    check_init_from(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, init_from=uri)))
    narrow = dataclasses.replace(cfg.model, hidden_size=64)
    with pytest.raises(ConfigError, match="^--init-from: .*saved hidden_size=128 but the config asks 64"):
        check_init_from(dataclasses.replace(cfg, model=narrow, run=dataclasses.replace(cfg.run, init_from=uri)))
    with pytest.raises(ConfigError, match="^--init-from: .* holds no config.json"):
        require_saved_model(f"{uri}-missing")


def test_results_written_under_an_s3_output_dir_land_in_the_bucket(s3):
    from ray_diloco.results import ResultsDir

    results = ResultsDir.of(f"{s3.new_bucket()}/runs", "first")
    assert results.read_text("config.yaml") is None
    assert results.write("config.yaml", lambda path: path.write_text("a: 1\n")) == f"{results.location}/config.yaml"

    def write_dir(path):
        path.mkdir()
        (path / "weights.bin").write_bytes(b"w")

    results.write("model", write_dir)
    assert results.write("loss.png", lambda path: None) is None  # nothing written: nothing uploaded
    assert keys(s3, results.location) == {"config.yaml", "model/weights.bin"}
    assert results.read_text("config.yaml") == "a: 1\n" and results.exists("config.yaml")


T = 1  # outer steps of the end-to-end run


def test_two_runs_at_once_with_every_path_in_one_bucket(s3):
    """The whole CLI path, twice at once in one bucket (two runs of one team, the same --checkpoint-path and
    --output-dir, other seeds): config, data and held-out data read from the bucket; Ray Train's storage, the outer
    checkpoints, the stored state records and the results written to it. Each run ends with its own checkpoints,
    which load back to the state it exported: neither continued, pruned or overwrote the other's."""
    bucket = s3.new_bucket()
    upload_sample(s3, f"{bucket}/c4")
    # name -> (seed, regions): two runs whose states differ, so a mix-up would show; the second has one region
    # (of the same name as the first's), which is all a collision needs and costs the 2 cores least.
    runs = {"s3run": (0, ("a", "b")), "s3run-2": (7, ("a",))}
    drivers, started = {}, time.monotonic()
    for name, (seed, regions) in runs.items():
        config = {"regions": [{"name": region, "workers": 1} for region in regions],
                  "outer": {"inner_steps": 2, "max_wait_seconds": 30, "matchmaking_seconds": 1,
                            "averaging_timeout": 30},
                  "inner": {"warmup_steps": 1},
                  "data": TEST_DATA,
                  "run": {"name": name, "seed": seed, "outer_steps": T, "checkpoint_every": 1, "eval_every": 0}}
        put(s3, f"{bucket}/{name}.yaml", yaml.safe_dump(config).encode())
        drivers[name] = Driver(["--config", f"{bucket}/{name}.yaml", "--data", f"{bucket}/c4/c4-train.*.json.gz",
                                "--eval-data", f"{bucket}/c4/c4-validation.00000-of-00001.json.gz",
                                "--checkpoint-path", f"{bucket}/ckpt", "--output-dir", f"{bucket}/runs"],
                               driver_env())
    for name, driver in drivers.items():
        code = driver.process.wait(timeout=900)
        assert code == 0, driver.output()[-4000:]
    print(f"two end-to-end runs at once: {time.monotonic() - started:.0f} s")
    exported = {name: check_run_in_bucket(s3, bucket, name, regions) for name, (_, regions) in runs.items()}
    assert exported["s3run"] != exported["s3run-2"]


def check_run_in_bucket(s3, bucket: str, name: str, regions: tuple[str, ...]) -> str:
    """The run's results, stored state records and checkpoints in the bucket; returns its exported digest."""
    from ray_diloco.checkpoint import CheckpointStore
    from ray_diloco.model import build_model
    from ray_diloco.worker_checkpoint import load_worker_checkpoint

    results = keys(s3, f"{bucket}/runs/{name}")
    assert {"summary.json", "config.yaml", "loss.png", "model/config.json", "model/model.safetensors"} <= results
    summary = json.loads(s3.filesystem().open_input_file(f"{bucket[5:]}/runs/{name}/summary.json").read())
    assert summary["outer_steps"] == T and (summary["regions_agree"] or len(regions) == 1), summary
    cfg = ExperimentConfig.from_dict(yaml.safe_load(
        s3.filesystem().open_input_file(f"{bucket[5:]}/runs/{name}/config.yaml").read()))
    assert cfg.data.path == f"{bucket}/c4/c4-train.*.json.gz"
    if len(regions) > 1:  # what outlives each region's driver (a run of one region keeps none)
        assert keys(s3, cfg.run.states_dir()) >= {f"{region}.json" for region in regions}
    for region in regions:
        store = CheckpointStore(join(cfg.run.checkpoint_root(), region))
        assert store.steps() == list(range(1, T + 1))
        saved = store.load()  # loads back from the bucket, and is the state the run exported
        assert saved.worker_checkpoint and saved.worker_checkpoint.startswith(f"{bucket}/ckpt/{name}/")
        assert state_digest(saved.theta) == summary["exported_digest"]
        # What a restarted or resumed worker reads: Ray Train's upload, read back through Ray Train's Checkpoint.
        model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, cfg.run.seed + 1)
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)  # the writer's was foreach=False (CPU)
        meta = load_worker_checkpoint(saved.worker_checkpoint, model, optimizer)
        assert meta["outer_step"] == T and optimizer.param_groups[0]["foreach"] is True  # this machine's kernels
        assert state_digest(parameter_state(model)) == summary["exported_digest"]
    return summary["exported_digest"]
