"""A benchmark given bad arguments says so in one line naming the flag and exits 2 (as argparse does for a bad
type, and as the CLI does), before it starts anything: they once exited 1 with a bare message."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, argv, message", [
    ("convergence.py", ["--steps", "10", "--h", "7"], "--h 7 must divide --steps 10"),
    ("convergence.py", ["--arms", "nothing-*"], "--arms 'nothing-*' names no arm"),
    ("convergence.py", ["--seeds", "1,1"], "--seeds 1,1: give each value once"),
    ("convergence.py", ["--h", "50,50"], "--h 50,50: give each value once"),
    ("tune.py", ["--outer-lrs", "0.7,0.70"], "--outer-lrs: give each value once, got '0.7,0.70'"),
    ("tune.py", ["--methods", "dct,dct"], "--methods: give each method once, got 'dct,dct'"),
    ("tune.py", ["--outer-lrs", "0.7,0"], "--outer-lrs: each must be > 0, got '0.7,0'"),
    ("tune.py", ["--methods", "adam"], "--methods: 'adam': choose from diloco, sparseloco, dct"),
    ("poisoned.py", ["--steps", "10", "--h", "7"], "--h 7 must divide --steps 10"),
    ("poisoned.py", ["--arms", "dirty-mean"], "--arms: ['dirty-mean'] unknown; choose from clean-mean"),
    ("compare.py", ["--arms", "dilcoo"], "--arms: ['dilcoo'] unknown; choose from ddp, "),
    ("overhead.py", ["--regions", "0"], "--regions takes comma-separated region counts >= 1, got '0' (see"),
    ("overhead.py", ["--outer-steps", "0"], "--outer-steps must be >= 1 (see"),  # names only the flag given
    ("overhead.py", ["--step-log", "--steps", "0"], "--steps must be >= 1"),  # before any rank starts
    ("overhead.py", ["--step-log", "--preset", "nope"], "argument --preset: invalid choice: 'nope'"),
    ("allreduce.py", ["--regions", "x"], "--regions takes comma-separated region counts"),  # was a traceback
])
def test_bad_arguments_are_one_line_and_exit_2(script, argv, message):
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *argv], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    # Before the expensive imports too (Ray and torch took compare.py and convergence.py ~6 s to refuse). Not yet
    # for overhead.py --step-log and allreduce.py: they import torch (and Hivemind) first, seconds on a busy machine.
    if "--step-log" not in argv and script != "allreduce.py":
        assert time.monotonic() - started < 10, f"{script} took {time.monotonic() - started:.1f} s to refuse"
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"{script}: error: {message}"), done.stderr
    assert done.stderr.count("\n") == 1 and not done.stdout, done.stderr


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_the_wan_benchmarks_region_configs_are_valid(tmp_path, overlap):
    """Its long bounds (a 20 Mbit/s link) need a stop timeout of two rounds: its overlapped cells were refused."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import wan
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from ray_diloco.config import ExperimentConfig

    path = wan.region_config(wan.build_parser().parse_args([]), "cell", "r0", overlap, tmp_path)
    assert ExperimentConfig.from_yaml(path.read_text()).outer.overlap == overlap


def test_poisoned_reads_back_only_a_finished_run_of_its_steps_and_factor(tmp_path, capsys):
    """Its arms were read back whatever their --steps, --h and --factor, and stopped part-way too."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("poisoned", ROOT / "benchmarks" / "poisoned.py")
    poisoned = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(poisoned)
    (tmp_path / "clean-mean").mkdir()
    summary = {"inner_steps": 5, "outer_steps": 2, "stopped": False, "eval_loss": 7.0, "eval_loss_at_start": 10.9,
               "regions_agree": True, "events": [], "wall_seconds": 60.0}
    (tmp_path / "clean-mean" / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "clean-mean.factor.json").write_text(json.dumps({"factor": None}))  # as run_arm records it
    argv = ["--arms", "clean-mean", "--steps", "10", "--h", "5", "--output-dir", str(tmp_path)]
    assert poisoned.main(argv) == 0  # read back
    assert poisoned.main([*argv[:5], "2", *argv[6:]]) == 1  # H = 2: another run
    assert "holds a run of H=5, 2 outer steps, region-c's Δ × None: give another" in capsys.readouterr().err
    (tmp_path / "clean-mean" / "summary.json").write_text(json.dumps({**summary, "stopped": True}))
    assert poisoned.main(argv) == 1
    assert "stopped part-way" in capsys.readouterr().err
    # A poisoned arm run with --factor 1000 is not read back as --factor 10's, nor one whose factor is unknown.
    (tmp_path / "poisoned-mean").mkdir()
    (tmp_path / "poisoned-mean" / "summary.json").write_text(json.dumps(summary))
    argv = ["--arms", "poisoned-mean", "--steps", "10", "--h", "5", "--output-dir", str(tmp_path)]
    assert poisoned.main(argv) == 1
    assert "region-c's Δ × unknown (not 1000.0): give another --output-dir" in capsys.readouterr().err
    (tmp_path / "poisoned-mean.factor.json").write_text(json.dumps({"factor": 1000.0}))
    assert poisoned.main(argv) == 0  # --factor's default, 1000
    assert poisoned.main([*argv, "--factor", "10"]) == 1
    assert "region-c's Δ × 1000.0 (not 10.0)" in capsys.readouterr().err
