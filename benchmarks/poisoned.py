"""A member that sends a poisoned Δ every round, under `--aggregation mean` and `clipped` (issue 24).

Runs arms through the CLI (`ray-diloco train`, a private local Ray each: FSDP2 over gloo, Hivemind on
127.0.0.1), three regions of one worker, the same seed and data, and prints the held-out loss of each against the
clean run under the mean. The poisoned region multiplies its Δ by `--factor` before sending it
(RAY_DILOCO_TEST_POISON, read by the SyncActor: ray_diloco/sync/rounds.py) — a region that holds the secret, so
authentication cannot keep it out.

    python benchmarks/poisoned.py --steps 200 --h 20 --output-dir runs/poisoned

Arms: clean-mean, poisoned-clipped, poisoned-mean, clean-clipped (what clipping costs without an attacker),
flipped-clipped (Δ × -1: the sign-flip the clipping does not catch); `--arms` runs some of them. Finished arms of
the same --steps, --h and factor are read back (resumable); writes poisoned.json and poisoned.md. "clipped events"
counts `contribution_clipped` events: one per region per round in which that region saw a contribution clipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from ray_diloco.cli import OneLineErrors

ROOT = Path(__file__).resolve().parents[1]
POISONED_REGION = "region-c"
# (label, aggregation, factor of the poisoned region's Δ or None)
ARMS = (("clean-mean", "mean", None), ("poisoned-clipped", "clipped", "factor"), ("poisoned-mean", "mean", "factor"),
        ("clean-clipped", "clipped", None), ("flipped-clipped", "clipped", -1.0))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="poisoned.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="inner steps per worker")
    parser.add_argument("--h", type=int, default=20, help="inner steps per round (must divide --steps)")
    parser.add_argument("--factor", type=float, default=1000.0, help="the poisoned region's Δ is multiplied by it")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "runs" / "poisoned")
    parser.add_argument("--arms", default=",".join(label for label, _, _ in ARMS),
                        help="comma-separated arms to run (finished ones are read back)")
    return parser


def factor_file(label: str, args: argparse.Namespace) -> Path:
    """Where an arm's factor is kept (the run's summary cannot say: the factor reaches only the SyncActor)."""
    return args.output_dir / f"{label}.factor.json"


def run_arm(label: str, aggregation: str, factor: float | None, args: argparse.Namespace) -> dict | None:
    """The arm's summary: read back if it ran to its end with this --steps and --h (its summary says) and this
    factor (`factor_file`), else run. A stopped or other run there is refused, not reported as this arm."""
    summary = args.output_dir / label / "summary.json"
    if summary.exists():
        done = json.loads(summary.read_text())
        ran = (done.get("inner_steps"), done.get("outer_steps"), bool(done.get("stopped")))
        recorded = factor_file(label, args)
        ran_factor = json.loads(recorded.read_text()).get("factor", "unknown") if recorded.exists() else "unknown"
        if ran == (args.h, args.steps // args.h, False) and ran_factor == factor:
            return done
        print(f"[poisoned] {label}: {summary.parent} holds a run of H={ran[0]}, {ran[1]} outer steps"
              f"{', stopped part-way' if ran[2] else ''}, {POISONED_REGION}'s Δ × {ran_factor}"
              f"{'' if ran_factor == factor else f' (not {factor})'}: give another --output-dir",
              file=sys.stderr, flush=True)
        return None
    from ray_diloco.sync.rounds import POISON_ENV_VAR  # here: torch loads only once an arm runs

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", POISON_ENV_VAR)}
    if factor is not None:
        env[POISON_ENV_VAR] = f"{POISONED_REGION}:{factor}"
    command = [sys.executable, "-m", "ray_diloco.cli", "train", "--regions", "3", "--workers-per-region", "1",
               "--inner-steps", str(args.h), "--outer-steps", str(args.steps // args.h), "--aggregation",
               aggregation, "--run-name", label, "--output-dir", str(args.output_dir), "--eval-every", "0"]
    log = args.output_dir / f"{label}.log"
    factor_file(label, args).write_text(json.dumps({"factor": factor}))
    print(f"[poisoned] {label}: starting ({log})", flush=True)
    with log.open("w") as handle:
        code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if code != 0 or not summary.exists():
        print(f"[poisoned] {label} failed (exit {code}); see {log}", file=sys.stderr, flush=True)
        return None
    return json.loads(summary.read_text())


def clipped_rounds(summary: dict) -> int:
    return sum(1 for e in summary.get("events", []) if e["event"] == "contribution_clipped")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.h < 1 or args.steps % args.h:
        parser.error(f"--h {args.h} must divide --steps {args.steps}")
    wanted = set(args.arms.split(","))
    if wanted - {label for label, _, _ in ARMS}:
        parser.error(f"--arms: {sorted(wanted - {label for label, _, _ in ARMS})} unknown; choose "
                     f"from {', '.join(label for label, _, _ in ARMS)}")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    arms = [arm for arm in ARMS if arm[0] in wanted]
    rows = []
    for label, aggregation, factor in arms:
        factor = args.factor if factor == "factor" else factor
        summary = run_arm(label, aggregation, factor, args)
        if summary is not None:
            rows.append({"arm": label, "aggregation": aggregation, "factor": factor,
                         "eval_loss": summary["eval_loss"], "eval_loss_at_start": summary["eval_loss_at_start"],
                         "regions_agree": summary["regions_agree"], "clipped_events": clipped_rounds(summary),
                         "wall_seconds": summary["wall_seconds"]})
    clean = next((r["eval_loss"] for r in rows if r["arm"] == "clean-mean"), None)
    lines = ["| arm | aggregation | region-c's Δ × | held-out loss | × clean mean | clipped events | agree |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['eval_loss'] / clean:.3f}" if clean else "-"
        lines.append(f"| {r['arm']} | {r['aggregation']} | {r['factor'] if r['factor'] is not None else '-'} "
                     f"| {r['eval_loss_at_start']:.3f} → {r['eval_loss']:.4f} | {ratio} | {r['clipped_events']} "
                     f"| {r['regions_agree']} |")
    table = "\n".join(lines) + (f"\n\n3 regions × 1 worker, {args.steps} inner steps per worker, H = {args.h}, "
                                f"tiny-cpu model. `python benchmarks/poisoned.py {' '.join(argv or sys.argv[1:])}`\n")
    (args.output_dir / "poisoned.json").write_text(json.dumps(rows, indent=2))
    (args.output_dir / "poisoned.md").write_text(table)
    print(table)
    return 0 if len(rows) == len(arms) else 1


if __name__ == "__main__":
    sys.exit(main())
