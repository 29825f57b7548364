"""`benchmarks/convergence.py` end to end at a tiny size: one arm, SparseLoCo over two real regions through the
CLI (`ray-diloco train` in its own process: Ray, FSDP2 over gloo, Hivemind), then the same invocation again.

Checks that the arm's regions agree, that the table and both plots are written with the arm's bits per parameter,
and that a second invocation reads the finished arm back instead of training it again (the grid resumes). And,
without training, that the command and YAML of every arm of the default grid make a configuration the CLI takes
(a baseline arm once asked for checkpoints, which only DiLoCo runs take, and every ddp and single arm failed)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import yaml

from ray_diloco.cli import build_parser, resolve_config
from ray_diloco.presets import tiny_cpu

ROOT = Path(__file__).resolve().parents[1]


def load_convergence():
    spec = importlib.util.spec_from_file_location("convergence", ROOT / "benchmarks" / "convergence.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_one_sparseloco_arm_of_two_regions_and_a_resumed_grid(tmp_path):
    convergence = load_convergence()
    argv = ["--steps", "4", "--h", "2", "--workers", "2", "--seeds", "0", "--evals", "1",
            "--arms", "sparseloco-1pct-h2", "--output-dir", str(tmp_path)]
    assert convergence.main(argv) == 0
    summary = json.loads((tmp_path / "arms" / "sparseloco-1pct-h2" / "summary.json").read_text())
    assert summary["outer_method"] == "sparseloco" and summary["regions_agree"]
    assert all(r["group_size"] == 2 for rounds in summary["rounds"].values() for r in rounds)
    (row,) = json.loads((tmp_path / "convergence.json").read_text())["rows"]
    assert 0 < row["bits_per_parameter"] < 1  # 41 of 4096 values at 2 bits, to the other region
    assert "sparseloco-1pct-h2" in (tmp_path / "convergence.md").read_text()
    assert (tmp_path / "convergence_loss.png").stat().st_size > 0 and (tmp_path / "convergence_pareto.png").exists()

    log = tmp_path / "arms" / "sparseloco-1pct-h2.log"
    assert "; outer sparseloco: H=2, top-41 of 4096 values per chunk, 2-bit, token-weighted mean, SGD lr 1.0" \
        in log.read_text()  # the driver's start line says what a round sends
    size = log.stat().st_size
    assert convergence.main(argv) == 0  # read back, not trained again
    assert log.stat().st_size == size


def test_every_arm_of_the_default_grid_is_a_configuration_the_cli_takes(tmp_path):
    convergence = load_convergence()
    parser = convergence.build_parser()
    args = parser.parse_args([])
    hs, seeds = convergence.check(args, parser)
    arms = convergence.grid(args.workers, hs, seeds)
    assert len({a.label for a in arms}) == len(arms) == 29
    for arm in arms:
        (tmp_path / f"{arm.label}.yaml").write_text(yaml.safe_dump(convergence.arm_config(arm, args)))
        argv = convergence.command(arm, args, tmp_path, resume=False)[3:]  # after "python -m ray_diloco.cli"
        cfg = resolve_config(build_parser().parse_args(argv))
        workers = sum(r.workers for r in cfg.regions)
        assert (cfg.run.mode, cfg.outer.method, cfg.total_inner_steps) == (arm.mode, arm.method, args.steps)
        assert workers == (1 if arm.mode == "single" else arm.regions * arm.workers_per_region), arm.label
        assert len(cfg.regions) == (1 if arm.mode != "diloco" else arm.regions), arm.label


def test_the_seed_is_in_every_label_but_seed_0s():
    """`--seeds 1` alone once gave the seed-0 labels: it read the seed-0 runs back and reported them as seed 1."""
    convergence = load_convergence()
    first = convergence.grid(2, [50], [0])
    again = convergence.grid(2, [50], [1])
    assert [a.seed for a in again] == [1] * len(first)
    assert [a.label for a in again] == [f"{a.label}-s1" for a in first]
    both = convergence.grid(2, [50], [0, 1])
    assert [a.label for a in both[:len(first)]] == [a.label for a in first]
    assert {a.label: a for a in again}["dct-k2-h50-s1"] == {a.label: a for a in both}["dct-k2-h50-s1"]


def write_finished_arm(convergence, arms_dir: Path, arm, args, summary: dict) -> None:
    """What `ray-diloco train` leaves for an arm run with `args`: its configuration beside its summary."""
    (arms_dir / arm.label).mkdir(parents=True, exist_ok=True)
    (arms_dir / f"{arm.label}.yaml").write_text(yaml.safe_dump(convergence.arm_config(arm, args)))
    cfg = resolve_config(build_parser().parse_args(convergence.command(arm, args, arms_dir, False)[3:]))
    (arms_dir / arm.label / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    (arms_dir / arm.label / "summary.json").write_text(json.dumps(summary))


def test_a_finished_arm_with_other_settings_is_not_read_back(tmp_path, capsys):
    """An output directory reused with another --steps or --workers: the finished arm is neither reported as this
    invocation's (its table leaves it out) nor silently trained over; an arm stopped part-way (Ctrl-C reaches its
    CLI, which writes a summary with `stopped: true`) is not a finished one."""
    convergence = load_convergence()
    argv = ["--steps", "8", "--h", "2", "--workers", "2", "--seeds", "0", "--arms", "dct-k2-h2",
            "--output-dir", str(tmp_path)]
    parser = convergence.build_parser()
    args = parser.parse_args(argv)
    arms = {a.label: a for a in convergence.grid(2, [2], [0])}
    arms_dir = tmp_path / "arms"
    write_finished_arm(convergence, arms_dir, arms["dct-k2-h2"], args, {"eval_loss": 7.0})
    assert convergence.settings_differ(arms["dct-k2-h2"], args, arms_dir) == ""
    assert convergence.finished_summary(arms["dct-k2-h2"], args, arms_dir) == {"eval_loss": 7.0}
    write_finished_arm(convergence, arms_dir, arms["ddp"], args, {"eval_loss": 7.5, "stopped": True})
    assert convergence.finished_summary(arms["ddp"], args, arms_dir) is None  # stopped: to be continued

    argv[1] = "4"
    assert convergence.main(argv) == 1
    assert "holds a run with other settings (run.outer_steps 4, not 2): give another --output-dir" \
        in capsys.readouterr().err
    assert not (arms_dir / "dct-k2-h2.log").exists()  # nothing trained
    assert not (tmp_path / "convergence.json").exists()

    three = parser.parse_args(["--steps", "8", "--h", "2", "--workers", "3", "--seeds", "0"])
    (dct_of_three,) = [a for a in convergence.grid(3, [2], [0]) if a.label == "dct-k2-h2"]
    assert convergence.settings_differ(dct_of_three, three, arms_dir) == (
        "regions [('region-a', 1), ('region-b', 1)], not [('region-a', 1), ('region-b', 1), ('region-c', 1)]")
    assert convergence.finished_summary(dct_of_three, three, arms_dir) is None  # not in the table either


def test_a_begun_arm_is_refused_with_other_settings_and_a_stopped_one_is_continued(tmp_path, monkeypatch, capsys):
    """An arm that only checkpointed (interrupted) with other settings is refused before its CLI starts: the CLI
    would continue it, changing its outer steps with a warning only. One stopped part-way (`stopped: true`) with
    the same settings is continued with --resume, not read back."""
    import torch

    from ray_diloco.checkpoint import CheckpointStore, OuterCheckpoint

    convergence = load_convergence()
    parser = convergence.build_parser()
    earlier = parser.parse_args(["--steps", "8", "--h", "2", "--workers", "2", "--seeds", "0"])
    arms = {a.label: a for a in convergence.grid(2, [2], [0])}
    arms_dir = tmp_path / "arms"
    for label in ("dct-k2-h2", "sparseloco-1pct-h2"):
        write_finished_arm(convergence, arms_dir, arms[label], earlier, {"eval_loss": 7.0, "stopped": True})
        for region in ("region-a", "region-b"):  # a committed checkpoint of each region
            CheckpointStore(str(arms_dir / label / "checkpoints" / region)).save(
                OuterCheckpoint(outer_step=1, theta={"w": torch.zeros(2)}, momentum={"w": torch.zeros(2)}))
    (arms_dir / "dct-k2-h2" / "summary.json").unlink()  # interrupted: checkpoints only
    started = []
    monkeypatch.setattr(convergence, "run_to_its_end", lambda cmd, log: started.append(cmd) or 1)

    later = parser.parse_args(["--steps", "4", "--h", "2", "--workers", "2", "--seeds", "0"])
    assert convergence.run_arm(arms["dct-k2-h2"], later, arms_dir) is None and not started
    assert "holds a run with other settings (run.outer_steps 4, not 2)" in capsys.readouterr().err
    assert convergence.run_arm(arms["sparseloco-1pct-h2"], earlier, arms_dir) is None  # stopped: continued
    (command,) = started
    assert command[-1] == "--resume" and command[command.index("--run-name") + 1] == "sparseloco-1pct-h2"


def test_a_continued_arms_wall_time_adds_up_its_invocations_and_one_started_again_counts_anew(tmp_path, monkeypatch):
    """summary.json holds the last invocation's wall time only; the table's is every invocation's since the arm
    (last) started from scratch."""
    import torch

    from ray_diloco.checkpoint import CheckpointStore, OuterCheckpoint

    convergence = load_convergence()
    args = convergence.build_parser().parse_args(["--steps", "8", "--h", "2", "--workers", "2", "--seeds", "0"])
    arms = {a.label: a for a in convergence.grid(2, [2], [0])}
    arms_dir = tmp_path / "arms"
    continued, fresh = arms["sparseloco-1pct-h2"], arms["dct-k2-h2"]
    write_finished_arm(convergence, arms_dir, continued, args, {"eval_loss": 7.0, "stopped": True})
    for region in ("region-a", "region-b"):
        CheckpointStore(str(arms_dir / continued.label / "checkpoints" / region)).save(
            OuterCheckpoint(outer_step=1, theta={"w": torch.zeros(2)}, momentum={"w": torch.zeros(2)}))
    for arm in (continued, fresh):  # an earlier invocation of each took 100 s
        (arms_dir / f"{arm.label}.seconds").write_text("100.0\n")
    monkeypatch.setattr(convergence, "run_to_its_end", lambda cmd, log: 1)
    convergence.run_arm(continued, args, arms_dir)
    convergence.run_arm(fresh, args, arms_dir)  # no checkpoint: it starts again, the 100 s trained nothing kept
    summary = {"wall_seconds": 1.0}  # the last invocation's, as summary.json has it
    assert 100.0 <= convergence.wall_seconds(continued, summary, arms_dir) < 110.0
    assert convergence.wall_seconds(fresh, summary, arms_dir) < 10.0
    assert convergence.wall_seconds(arms["ddp"], summary, arms_dir) == 1.0  # run before the file: the summary's


def test_the_first_ctrl_c_lets_the_arm_stop_at_its_boundary(tmp_path):
    """Ctrl-C signals the whole process group: the grid and the arm's CLI. The grid waits for the CLI to end at its
    next outer step (a plain subprocess.call killed it after 0.25 s, losing everything since its checkpoint)."""
    import signal
    import subprocess
    import time

    started, ended = tmp_path / "started", tmp_path / "ended"
    child = (f"import signal, time, pathlib\n"  # a CLI that needs a moment to reach its boundary
             f"def stop(*_):\n"
             f"    time.sleep(1.0)\n"
             f"    pathlib.Path({str(ended)!r}).touch()\n"
             f"    raise SystemExit(0)\n"
             f"signal.signal(signal.SIGINT, stop)\n"
             f"pathlib.Path({str(started)!r}).touch()\n"
             f"time.sleep(60)\n")
    # A process started in the background inherits SIGINT ignored (CI runs so): Python, started from a terminal,
    # turns it into KeyboardInterrupt, and so does the grid here.
    grid = (f"import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
            f"import convergence\n"
            f"convergence.run_to_its_end([sys.executable, '-c', {child!r}], sys.stdout)\n")
    process = subprocess.Popen([sys.executable, "-c", grid], start_new_session=True, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.monotonic() + 60
    while not started.exists():  # the grid imports ray_diloco's CLI first
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGINT)  # what the terminal does
    _, err = process.communicate(timeout=60)
    assert ended.exists(), err  # the arm ended on its own, not killed
    assert "KeyboardInterrupt" in err and "the arm ends at its next outer step" in err


def test_the_tuning_runs_train_on_the_split_and_are_evaluated_on_its_validation_shard(tmp_path):
    """benchmarks/tune.py: every run is the grid's arm of its method with its outer lr, trained on shards 0-6 of
    the bundled sample and evaluated on shard 7, never on the held-out file the grid reports."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import convergence
        import tune
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from ray_diloco.data.files import embedded_eval_path, list_data_files

    parser = tune.build_parser()
    args = parser.parse_args(["--methods", "diloco,dct", "--outer-lrs", "0.5,1.0"])
    arms = tune.arms(*tune.check(args, parser), args)
    assert [(a.method, a.flags[1]) for a in arms] == [("diloco", "0.5"), ("diloco", "1.0"), ("dct", "0.5"),
                                                       ("dct", "1.0")]
    # A warm-up sweep: a run per warm-up, each labelled apart, the arm's YAML setting the inner lr's warm-up.
    # With another seed, which the labels name (and the runs take: --seed).
    args = parser.parse_args(["--methods", "diloco", "--outer-lrs", "0.7", "--warmup-steps", "0,50", "--seed", "1"])
    swept = tune.arms(*tune.check(args, parser), args)
    assert [(a.label, a.warmup_steps, a.seed) for a in swept] == [("diloco-m2-sfp16-h50-lr0p7-wu0-s1", 0, 1),
                                                                  ("diloco-m2-sfp16-h50-lr0p7-wu50-s1", 50, 1)]
    arms += swept
    for arm in arms:
        (tmp_path / f"{arm.label}.yaml").write_text(yaml.safe_dump(convergence.arm_config(arm, args)))
        cfg = resolve_config(build_parser().parse_args(convergence.command(arm, args, tmp_path, resume=False)[3:]))
        assert cfg.outer.lr == float(arm.flags[1]) and cfg.outer.method == arm.method and cfg.run.seed == arm.seed
        preset = tiny_cpu().inner.warmup_steps
        assert cfg.inner.warmup_steps == (preset if arm.warmup_steps is None else arm.warmup_steps)
        training, validation = set(list_data_files(cfg.data.path)), set(list_data_files(cfg.data.eval_path))
        assert len(training) == 7 and len(validation) == 1 and not training & validation
        assert embedded_eval_path() not in training | validation
