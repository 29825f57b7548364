"""The command line does what the user asked: flags keep the preset's resources, zero values reach validation,
bad YAML and bad list elements are one-line errors with exit code 2, runs get fresh names, resuming needs one,
and `--local-regions` picks regions of the full list (unknown names refused).
"""

import re

import pytest

from ray_diloco.cli import build_parser, main, resolve_config
from ray_diloco.config import ConfigError, ExperimentConfig


def resolved(*argv):
    return resolve_config(build_parser().parse_args(["train", *argv]))


def test_regions_flag_keeps_the_presets_per_worker_resources():
    cfg = resolved("--preset", "150m", "--regions", "3")
    assert [r.name for r in cfg.regions] == ["region-a", "region-b", "region-c"]
    assert {(r.workers, r.cpus_per_worker, r.gpus_per_worker) for r in cfg.regions} == {(8, 8.0, 1.0)}
    named = resolved("--preset", "150m", "--regions", "us,eu", "--workers-per-region", "2")
    assert [(r.name, r.workers, r.gpus_per_worker) for r in named.regions] == [("us", 2, 1.0), ("eu", 2, 1.0)]


def test_a_region_named_twice_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match=r"^--regions: each region once, got eu more than once$"):
        resolved("--regions", "us,eu,eu")


@pytest.mark.parametrize("flag", ["--workers-per-region", "--inner-steps", "--outer-steps"])
def test_zero_is_refused_naming_the_flag(flag):
    with pytest.raises(ConfigError, match=f"^{flag}: must be >= 1, got 0"):
        resolved(flag, "0")


def test_zero_reaches_the_config_where_it_is_valid():
    assert resolved("--eval-every", "0", "--checkpoint-every", "0").run.eval_every == 0
    assert resolved("--max-failures", "0").run.max_failures == 0  # default 1: 0 must not be ignored


def test_malformed_yaml_is_one_line_with_file_line_column_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("outer:\n  inner_steps: 5\n  compression: [fp16\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(rf"--config: {re.escape(str(bad))}:\d+:\d+: invalid YAML", err), err


def test_list_elements_are_type_checked():
    with pytest.raises(ConfigError, match=r"^outer.initial_peers\[0\]: expected str, got 1"):
        ExperimentConfig.from_yaml("outer: {initial_peers: [1, 2]}")
    assert ExperimentConfig.from_yaml("outer: {initial_peers: ['/ip4/1.2.3.4/tcp/1']}").outer.initial_peers


def test_runs_without_a_name_get_a_fresh_one_and_resume_needs_a_name():
    first, second = resolved().run.name, resolved().run.name
    assert first != second and first.startswith("tiny-cpu-") and second.startswith("tiny-cpu-")
    assert resolved("--preset", "150m").run.name.startswith("150m-")
    assert resolved("--run-name", "mine").run.name == "mine"
    with pytest.raises(ConfigError, match="^--resume: name the run"):
        resolved("--resume")


def test_config_command_prints_yaml_that_reads_back(capsys):
    assert main(["config", "--preset", "150m"]) == 0
    again = ExperimentConfig.from_yaml(capsys.readouterr().out)
    assert again.regions[0].gpus_per_worker == 1.0


@pytest.mark.parametrize("argv, flag", [(["train", "--compression", "int8"], "--compression"),
                                        (["train", "--workers-per-region", "abc"], "--workers-per-region"),
                                        (["bogus"], "command")])
def test_a_bad_flag_value_is_one_line_too(argv, flag, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ray-diloco: error: argument ") and flag in err[0], err


def test_local_regions_keep_the_full_list_and_refuse_unknown_names():
    cfg = resolved("--regions", "us,eu,ap", "--local-regions", "eu")
    assert [r.name for r in cfg.regions] == ["us", "eu", "ap"]  # the run's regions: split, protocol, run id
    assert [r.name for r in cfg.local_regions()] == ["eu"]  # what this Ray cluster runs
    with pytest.raises(ConfigError, match=r"^--local-regions: \['xx'\] given; name regions of the config"):
        resolved("--regions", "us,eu", "--local-regions", "xx")
    with pytest.raises(ConfigError, match="^run.local_regions: only DiLoCo runs span Ray clusters"):
        resolved("--regions", "us,eu", "--local-regions", "eu", "--mode", "ddp")


def test_the_command_line_loads_no_torch_before_its_checks():
    """A bad flag costs seconds: the CLI, the config and every name they check are torch-free (the CLI imported
    the codec registry, and with it torch: 2 s idle, 20-40 s on a busy machine, before any check ran)."""
    import subprocess
    import sys

    code = ("import sys, ray_diloco.cli as cli; cli.build_parser(); "
            "from ray_diloco.config import ExperimentConfig; ExperimentConfig(); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def train_in_a_process(tmp_path, *argv, env=None):
    """`ray-diloco train` in a process of its own (Ray's state is per process), on the bundled data."""
    import os
    import subprocess
    import sys

    env = {**os.environ, **(env or {})}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "ray_diloco.cli", "train", "--regions", "1",
                           "--output-dir", str(tmp_path / "out"), *argv], env=env, capture_output=True, text=True,
                          timeout=120)


def test_an_address_where_no_cluster_answers_is_a_one_line_error_naming_the_flag(tmp_path):
    """It was ~30 s of Ray's GCS retry lines and a ConnectionError traceback (a new user's try)."""
    import socket

    with socket.socket() as closed:  # a port nothing listens on: refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    done = train_in_a_process(tmp_path, "--address", f"127.0.0.1:{port}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        f"ray-diloco: error: --address 127.0.0.1:{port}: no Ray cluster answers there (Connection refused); give the "
        "head's address (`ray status` on the head prints it), or leave it out for a private local Ray"], done.stderr


def test_address_auto_without_a_cluster_on_this_machine_is_a_one_line_error(tmp_path):
    """`--address auto` (the README's) where no `ray start` runs here: Ray's ConnectionError was a 28-line
    traceback. Ray finds a cluster by its address file (under RAY_TMPDIR: empty here) or a running GCS process."""
    import psutil

    if any("gcs_server" in (p.info["name"] or "") for p in psutil.process_iter(["name"])):
        pytest.skip("a Ray cluster runs on this machine: `--address auto` would attach to it")
    done = train_in_a_process(tmp_path, "--address", "auto", env={"RAY_TMPDIR": str(tmp_path / "no-ray")})
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ray-diloco: error: --address auto: "), done.stderr[-3000:]
    assert "ray start --head" in lines[0], lines
