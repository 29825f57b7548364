"""The baselines through the command line, as a user runs them: `ray-diloco train --mode ddp` and
`--mode single` finish and write summary.json (both crashed after training with a NameError in the driver),
and bad inputs end in one line with exit code 2 before any work, writing nothing."""

import json
import subprocess
import sys
import time

import pytest

from ray_diloco.cli import main
from ray_diloco.resources import LOCAL_WORKERS_PER_CORE, local_cores

# Per region, one worker more than this machine's cores can take turns on across the default 2 regions: derived
# from the machine, so the case is refused on any (a fixed count starts a real run on a bigger one).
TOO_MANY_PER_REGION = LOCAL_WORKERS_PER_CORE * local_cores() // 2 + 1


@pytest.mark.parametrize("mode, groups", [("ddp", [("ddp", 2)]), ("single", [("single", 1)])])
def test_baseline_modes_finish_through_the_cli(local_ray, tmp_path, mode, groups):
    code = main(["train", "--mode", mode, "--regions", "2", "--outer-steps", "1", "--inner-steps", "5",
                 "--output-dir", str(tmp_path), "--run-name", mode])
    assert code == 0
    summary = json.loads((tmp_path / mode / "summary.json").read_text())
    assert summary["mode"] == mode
    assert [(g["name"], g["workers"]) for g in summary["regions"]] == groups
    assert summary["tokens"] == 5 * 8 * 128 * groups[0][1]  # steps x batch x seq_len x workers
    assert summary["eval_loss"] < summary["eval_loss_at_start"]
    assert (tmp_path / mode / "model" / "config.json").is_file()


def cli(*argv, cwd):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ray_diloco.cli", "train", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - started


@pytest.mark.parametrize("argv, message", [
    (["--data", "/nonexistent"], "--data: "),
    (["--eval-data", "/nonexistent/x.json.gz"], "--eval-data: "),
    (["--workers-per-region", "0"], "--workers-per-region: must be >= 1"),
    # more than this machine can take turns on: refused before the run's setup (the tokenizer, the data's files)
    (["--workers-per-region", str(TOO_MANY_PER_REGION)],
     f"--workers-per-region: the run starts up to {2 * TOO_MANY_PER_REGION} training workers"),
    (["--init-from", "/nonexistent"], "--init-from: "),
    (["--resume"], "--resume: name the run"),
    (["--run-name", "none-yet", "--resume"], "--resume: no committed checkpoint"),
    (["--regions", "9"], "regions"),  # 8 bundled files: a region would have none
    (["--secret-file", "/nonexistent/run.secret"], "--secret-file /nonexistent/run.secret: cannot be read"),
])
def test_bad_input_is_one_line_exit_2_within_5_seconds_and_writes_nothing(tmp_path, argv, message):
    done, seconds = cli(*argv, "--output-dir", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ray-diloco: error: ") and message in lines[0], done.stderr
    assert seconds < 5, seconds
    assert not (tmp_path / "out").exists()


def test_records_without_text_are_refused_before_ray(tmp_path):
    import gzip

    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        with gzip.open(data / f"c4-train.0000{i}-of-00002.json.gz", "wt") as f:
            f.writelines(json.dumps({"content": f"no text field {n}"}) + "\n" for n in range(30))
    done, seconds = cli("--data", str(data), "--output-dir", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2 and "--data: " in done.stderr and "'text'" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and seconds < 5
    assert not (tmp_path / "out").exists()


def test_more_workers_than_this_machine_can_take_turns_on_fail_before_ray_starts(tmp_path, monkeypatch, capsys):
    # In this process, with the driver replaced: were the check to break, no Ray of hundreds of workers starts.
    import ray_diloco.driver

    def reached(*args, **kwargs):
        raise AssertionError("the driver was reached")

    monkeypatch.setattr(ray_diloco.driver, "run_training", reached)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    workers = LOCAL_WORKERS_PER_CORE * local_cores() + 1
    assert main(["train", "--regions", "1", "--workers-per-region", str(workers), "--output-dir",
                 str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"--workers-per-region: the run starts up to {workers} training workers" in lines[0]
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv("RAY_ADDRESS", "203.0.113.7:6379")  # a cluster (`ray job submit`): sized by check_cluster
    with pytest.raises(AssertionError, match="the driver was reached"):
        main(["train", "--regions", "1", "--workers-per-region", str(workers), "--output-dir", str(tmp_path / "out")])


def test_a_gpu_preset_on_a_machine_without_gpus_fails_before_ray_starts(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU: the 150m preset could start here")
    done, seconds = cli("--preset", "150m", "--output-dir", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2 and "the run needs 16 GPU" in done.stderr, done.stderr
    assert "started a private local Ray" not in done.stdout and not (tmp_path / "out").exists()
