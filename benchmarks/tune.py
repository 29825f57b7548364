"""The outer learning rate of each outer method (and H, and the inner lr's warm-up), tuned on a validation split,
never on the held-out set.

    python benchmarks/tune.py                                  # diloco and sparseloco, 3 outer lrs each
    python benchmarks/tune.py --methods diloco --outer-lrs 0.5,0.7,1.0 --steps 600
    python benchmarks/tune.py --methods diloco --outer-lrs 0.7 --warmup-steps 0,50,150 --output-dir runs/tune-warmup

Each run is an arm of `convergence.py` (the CLI, as a user runs it; resumable the same way) with two changes: it
trains on the bundled C4 sample's training shards 0-6 only (`--data`) and is evaluated on shard 7 (`--eval-data`),
the validation split. Its documents are in no tuning run's training data, and they are not the held-out shard that
`convergence.py` reports (the bundled validation file), so the grid's held-out numbers stay untouched by the choice.
Writes `tune.json` and `tune.md`: the validation loss per method, outer lr (and warm-up), the lowest of each method
marked. H is one per invocation (`--h`): sweep it with an output directory per value.
Shorter than the grid (`--steps`, default 600): a short-horizon choice, which the table says.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # convergence.py, beside this file
from convergence import Arm, grid, run_arm, with_seed  # noqa: E402

from ray_diloco.cli import OneLineErrors  # noqa: E402

SHARDS = 8  # the bundled sample: c4-train.0000K-of-00008.json.gz, K = 0..7
METHODS = {"diloco": "diloco-m{w}-sfp16-h{h}", "sparseloco": "sparseloco-1pct-h{h}", "dct": "dct-k2-h{h}"}


def split_paths() -> tuple[str, str]:
    """(the training glob: shards 0..6, the validation shard: 7) of the bundled C4 sample."""
    from ray_diloco.data.files import embedded_train_dir

    root = Path(embedded_train_dir())
    return (str(root / f"c4-train.0000[0-{SHARDS - 2}]-of-0000{SHARDS}.json.gz"),
            str(root / f"c4-train.0000{SHARDS - 1}-of-0000{SHARDS}.json.gz"))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="tune.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="diloco,sparseloco", help=f"of {', '.join(METHODS)} (default "
                        "diloco,sparseloco)")
    parser.add_argument("--outer-lrs", default="0.5,0.7,1.0", help="outer learning rates (default 0.5,0.7,1.0)")
    parser.add_argument("--steps", type=int, default=600, help="inner steps per worker of every run (default 600)")
    parser.add_argument("--h", type=int, default=50, help="H (default 50)")
    parser.add_argument("--workers", type=int, default=2, help="regions, one worker each (default 2)")
    parser.add_argument("--batch-size", type=int, default=3, help="windows per step per worker (default 3)")
    parser.add_argument("--evals", type=int, default=4, help="validation evaluations per run (default 4)")
    parser.add_argument("--warmup-steps", default=None, help="inner lr warm-up steps to sweep, comma-separated "
                        "(default: the preset's alone)")
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed (default 0; another is in their labels)")
    parser.add_argument("--output-dir", default="runs/tune", help="where the runs, tune.json and tune.md go; the "
                        "same directory again continues a sweep (default runs/tune)")
    return parser


def check(args: argparse.Namespace,
          parser: argparse.ArgumentParser) -> tuple[list[str], list[float], list[int | None]]:
    """The methods, outer lrs and warm-ups ([None]: the preset's) to sweep, or a one-line error."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or any(m not in METHODS for m in methods):
        parser.error(f"--methods: {args.methods!r}: choose from {', '.join(METHODS)}")
    if len(set(methods)) < len(methods):  # one label per run: a second would only read the first back
        parser.error(f"--methods: give each method once, got {args.methods!r}")
    try:
        lrs = [float(v) for v in args.outer_lrs.split(",")]
    except ValueError:
        parser.error(f"--outer-lrs takes comma-separated numbers, got {args.outer_lrs!r}")
    if not lrs or any(not (math.isfinite(lr) and lr > 0) for lr in lrs):
        parser.error(f"--outer-lrs: each must be > 0, got {args.outer_lrs!r}")
    if len({f"{lr:g}" for lr in lrs}) < len(lrs):  # the labels' spelling of the rate
        parser.error(f"--outer-lrs: give each value once, got {args.outer_lrs!r}")
    try:
        warmups = [None] if args.warmup_steps is None else [int(v) for v in args.warmup_steps.split(",")]
    except ValueError:
        parser.error(f"--warmup-steps takes comma-separated integers, got {args.warmup_steps!r}")
    if any(w is not None and w < 0 for w in warmups) or len(set(warmups)) < len(warmups):
        parser.error(f"--warmup-steps: each must be >= 0 and given once, got {args.warmup_steps!r}")
    if args.h < 1 or args.steps % args.h:
        parser.error(f"--h {args.h} must divide --steps {args.steps}")
    bad = [f"--{name.replace('_', '-')} must be >= 1" for name in ("workers", "batch_size", "evals")
           if getattr(args, name) < 1] + (["--seed must be >= 0"] if args.seed < 0 else [])
    if bad:
        parser.error("; ".join(bad))
    return methods, lrs, warmups


def arms(methods: list[str], lrs: list[float], warmups: list[int | None], args: argparse.Namespace) -> list[Arm]:
    """The grid's arm of each method, once per outer lr (and warm-up), on the split."""
    train, validation = split_paths()
    by_label = {a.label: a for a in grid(args.workers, [args.h], [0])}

    def run(method: str, lr: float, warmup: int | None) -> Arm:
        base = by_label[METHODS[method].format(w=args.workers, h=args.h)]
        label = f"{base.label}-lr{lr:g}" + ("" if warmup is None else f"-wu{warmup}")
        arm = dataclasses.replace(base, label=label.replace(".", "p"), warmup_steps=warmup,
                                  flags=("--outer-lr", str(lr), "--data", train, "--eval-data", validation))
        return with_seed(arm, args.seed)

    return [run(m, lr, warmup) for m in methods for lr in lrs for warmup in warmups]


def table(results: list[dict], args: argparse.Namespace) -> str:
    best = {}
    for r in results:
        if math.isfinite(r["validation_loss"]) and r["validation_loss"] < best.get(r["method"], (math.inf,))[0]:
            best[r["method"]] = (r["validation_loss"], r["arm"])
    lines = ["| method | outer lr | warm-up steps | validation loss | wall s |", "|---|---|---|---|---|"]
    for r in results:
        mark = " (lowest)" if best.get(r["method"], (None, None))[1] == r["arm"] else ""
        warmup = "the preset's" if r.get("warmup_steps") is None else r["warmup_steps"]
        lines.append(f"| {r['method']} | {r['outer_lr']:g} | {warmup} | {r['validation_loss']:.4f}{mark} "
                     f"| {r['wall_seconds']:.0f} |")
    return "\n".join(lines) + (f"\n\n{args.steps} inner steps per worker, H = {args.h}, {args.workers} regions, seed "
                               f"{args.seed}, "
                               "trained on the bundled C4 sample's shards 0-6, evaluated on shard 7.\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    methods, lrs, warmups = check(args, parser)
    out = Path(args.output_dir).resolve()
    arms_dir = out / "arms"
    arms_dir.mkdir(parents=True, exist_ok=True)
    results, failed = [], []
    for arm in arms(methods, lrs, warmups, args):
        try:
            summary = run_arm(arm, args, arms_dir)
        except KeyboardInterrupt:  # the run has ended (stopped, with a checkpoint, or forced): convergence.run_arm
            print(f"[tune] stopped at {arm.label}: the same command continues the sweep", file=sys.stderr)
            return 130
        if summary is None:
            failed.append(arm.label)
            continue
        results.append({"arm": arm.label, "method": arm.method,
                        "outer_lr": float(arm.flags[1]), "warmup_steps": arm.warmup_steps,
                        "validation_loss": summary["eval_loss"],
                        "wall_seconds": summary["wall_seconds"]})
        (out / "tune.json").write_text(json.dumps({"argv": list(sys.argv[1:] if argv is None else argv),
                                                   "results": results}, indent=2))
        (out / "tune.md").write_text(table(results, args))
    print(f"[tune] {len(results)} runs; {out / 'tune.md'}" + (f"; failed: {failed}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
