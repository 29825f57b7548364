"""DiLoCo against its baselines, in one invocation, from one warm start.

    python benchmarks/compare.py                        # the default: ~17 min on 2 CPU cores
    python benchmarks/compare.py --outer-steps 4 --inner-steps 50 --output-dir runs/compare-long

First a short pretraining run (mode `single`, `--warmup-steps` steps) saves a model; every arm starts
from it (`run.init_from`). Then, with the same seed, data, model, inner AdamW and schedule, and the same
number of inner steps (so the same tokens) per worker:

* `ddp`          one Ray Train group of `--workers` workers, fp32 gradient all-reduce every step;
* `diloco-none`  `--workers` regions × 1 worker, an outer step every H inner steps, fp32 on the wire;
* `diloco-fp16`  the same with fp16 pseudo-gradients on the wire;
* `diloco-scaled-fp16`  the same with scaled fp16 (a power-of-two scale per part: no clamping, no flush to 0);
* `single`       one worker.

It prints and writes `compare.json` and `compare.md` (a table: held-out loss and perplexity of the final
model — θ_global for DiLoCo —, tokens, bytes sent per region or per DDP worker and their ratio to DDP,
tokens/s per worker, wall time) and `compare_loss.png` (held-out loss against tokens per worker).
`main(argv)` is importable, so tests run it in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ray_diloco.cli import OneLineErrors
from ray_diloco.config import ExperimentConfig, RegionConfig
from ray_diloco.presets import tiny_cpu

DEFAULT_OUTPUT_DIR = "runs/compare"
ARMS_DIR = "arms"  # the runs of one invocation, started afresh each time: never a user's runs beside them
# Arms in table order: (label, mode, compression). Compression only matters for diloco.
ARMS = (("ddp", "ddp", "none"), ("diloco-none", "diloco", "none"), ("diloco-fp16", "diloco", "fp16"),
        ("diloco-scaled-fp16", "diloco", "scaled-fp16"),
        ("single", "single", "none"))
CODEC_BYTES = {"none": 4, "fp16": 2, "bf16": 2, "scaled-fp16": 2}  # + 4 bytes of scale per part


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(
        prog="compare.py", description="DiLoCo (none/fp16 wire) vs DDP vs one worker, from one warm start, "
                                       "at equal tokens per worker (tiny-cpu model).")
    parser.add_argument("--workers", type=int, default=4,
                        help="DDP workers = DiLoCo regions (1 worker each) (default 4)")
    parser.add_argument("--inner-steps", type=int, default=50, metavar="H",
                        help="DiLoCo inner steps between outer steps (default 50)")
    parser.add_argument("--outer-steps", type=int, default=2, metavar="T",
                        help="outer steps; every arm trains T×H inner steps per worker (default 2)")
    parser.add_argument("--warmup-steps", type=int, default=50, metavar="W",
                        help="steps of the warm-start pretraining run (mode single) all arms start from; "
                             "not the learning-rate warmup (default 50)")
    parser.add_argument("--baseline-eval-steps", type=int, default=0, metavar="K",
                        help="evaluate ddp and single every K inner steps for a finer curve (must divide T×H); "
                             "0 = at DiLoCo's outer steps, like DiLoCo (default; extra evaluations share the "
                             "CPUs with training and lower the baselines' tokens/s)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per window (default: tiny-cpu's 128)")
    parser.add_argument("--batch-size", type=int, default=3,
                        help="windows per step per worker (default 3, not tiny-cpu's 8: the default run then "
                             "fits in 20 min on 2 cores; it took 21 min with 4)")
    parser.add_argument("--eval-windows", type=int, default=None, help="held-out windows (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", metavar="PATH_OR_GLOB", help="training files (default: the bundled C4 sample)")
    parser.add_argument("--eval-data", metavar="PATH_OR_GLOB", help="held-out files (default: bundled)")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                        help=f"runs and results go here (default {DEFAULT_OUTPUT_DIR})")
    parser.add_argument("--plot", metavar="PNG", help="where the loss plot goes (default OUTPUT_DIR/compare_loss.png)")
    parser.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    parser.add_argument("--arms", default=",".join(label for label, _, _ in ARMS),
                        help="comma-separated arms to run, in table order; ddp is always run (the byte ratios are "
                             "to it) (default: all: %(default)s)")
    return parser


def chosen_arms(value: str) -> tuple[tuple[str, str, str], ...]:
    """The arms `--arms` names, in table order, ddp always among them."""
    wanted = {label.strip() for label in value.split(",") if label.strip()} | {"ddp"}
    unknown = wanted - {label for label, _, _ in ARMS}
    if unknown:
        raise ValueError(f"--arms: {sorted(unknown)} unknown; choose from "
                         f"{', '.join(label for label, _, _ in ARMS)}")
    return tuple(arm for arm in ARMS if arm[0] in wanted)


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    problems = []
    for name in ("workers", "inner_steps", "outer_steps", "warmup_steps"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.workers < 2:
        problems.append("--workers must be >= 2: DiLoCo needs 2 regions and DDP 2 workers to send anything")
    total = args.inner_steps * args.outer_steps
    if args.baseline_eval_steps < 0 or (args.baseline_eval_steps and total % args.baseline_eval_steps):
        problems.append(f"--baseline-eval-steps must be 0 or divide T×H = {total}")
    try:
        chosen_arms(args.arms)
    except ValueError as error:
        problems.append(str(error))
    if problems:
        parser.error("; ".join(problems))


def base_config(args: argparse.Namespace) -> ExperimentConfig:
    """tiny-cpu with the sizes and data of the flags; `--workers` regions of 1 worker each."""
    cfg = tiny_cpu()
    data = dataclasses.replace(
        cfg.data,
        path=args.data or cfg.data.path,
        eval_path=args.eval_data or cfg.data.eval_path,
        seq_len=args.seq_len or cfg.data.seq_len,
        batch_size=args.batch_size or cfg.data.batch_size,
        eval_windows=args.eval_windows or cfg.data.eval_windows,
    )
    # Matchmaking waits for every region (a round starts as soon as all are in); the long bound only
    # keeps 4 regions sharing 2 busy cores from averaging in part-groups. It changes no numerics.
    outer = dataclasses.replace(cfg.outer, inner_steps=args.inner_steps, matchmaking_seconds=120.0,
                                averaging_timeout=300.0)
    run = dataclasses.replace(cfg.run, outer_steps=args.outer_steps, seed=args.seed,
                              output_dir=str(Path(args.output_dir).resolve() / ARMS_DIR), eval_every=1)
    regions = [RegionConfig(name=f"region-{i}", workers=1) for i in range(args.workers)]
    return dataclasses.replace(cfg, data=data, outer=outer, run=run, regions=regions)


def warm_start_config(base: ExperimentConfig, steps: int) -> ExperimentConfig:
    run = dataclasses.replace(base.run, name="warm-start", mode="single", outer_steps=1, eval_every=0)
    return dataclasses.replace(base, outer=dataclasses.replace(base.outer, inner_steps=steps), run=run)


def arm_config(base: ExperimentConfig, label: str, mode: str, compression: str, init_from: str,
               baseline_eval_steps: int) -> ExperimentConfig:
    """One arm: only the mode (and the wire codec for diloco) differ from `base`."""
    outer, run = base.outer, dataclasses.replace(base.run, name=label, mode=mode, init_from=init_from)
    outer = dataclasses.replace(outer, compression=compression)
    if mode != "diloco" and baseline_eval_steps:
        # ddp and single have no outer step: H only sets how often they are evaluated. Same total steps,
        # so the same learning-rate schedule and data.
        total = base.total_inner_steps
        outer = dataclasses.replace(outer, inner_steps=baseline_eval_steps)
        run = dataclasses.replace(run, outer_steps=total // baseline_eval_steps)
    return dataclasses.replace(base, outer=outer, run=run)


def machine_info() -> dict[str, Any]:
    import ray
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import hivemind

        hivemind_version = hivemind.__version__
    except Exception:  # reported, not needed
        hivemind_version = "unknown"
    return {"nproc": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version(),
            "torch": torch.__version__, "ray": ray.__version__, "hivemind": hivemind_version,
            "platform": platform.platform()}


def row_of(label: str, summary: dict[str, Any], ddp_bytes_per_worker: int | None) -> dict[str, Any]:
    """One table row from a run's summary.json. Bytes: per region for DiLoCo, per worker for DDP."""
    mode = summary["mode"]
    groups = summary["regions"]
    steps = summary["inner_steps"] * summary["outer_steps"]
    workers = sum(g["workers"] for g in groups)
    sent = summary["comm_bytes_sent"]
    # Tokens are counted by the groups that finished (all of them, unless a region left the run).
    reporting = sum(g["workers"] for g in groups if g["name"] in sent) or workers
    if mode == "diloco":
        per_region = sum(sent.values()) / len(sent)
        expected = CODEC_BYTES[summary["compression"]] / 4 / summary["inner_steps"]
    elif mode == "ddp":
        per_region, expected = sum(sent.values()) / len(sent), 1.0  # one group: bytes per worker
    else:
        per_region, expected = 0.0, 0.0
    rounds = [r for region_rounds in summary.get("rounds", {}).values() for r in region_rounds]
    notes = run_notes(summary)
    return {
        "run": label,
        "mode": mode,
        "groups": f"{len(groups)}×{groups[0]['workers']}" if mode == "diloco" else f"1×{workers}",
        "workers": workers,
        "compression": summary["compression"] if mode == "diloco" else "-",
        "inner_steps": summary["inner_steps"] if mode == "diloco" else None,
        "steps_per_worker": steps,
        "tokens": summary["tokens"],
        "tokens_per_worker": summary["tokens"] // reporting,
        "eval_loss_at_start": summary["eval_loss_at_start"],
        "eval_loss": summary["eval_loss"],
        "eval_perplexity": summary["eval_perplexity"],
        "bytes_sent_per_region": per_region,
        "bytes_sent_by_group": dict(sent),
        "bytes_ratio_to_ddp": per_region / ddp_bytes_per_worker if ddp_bytes_per_worker else None,
        "expected_bytes_ratio": expected,
        "tokens_per_second_per_worker": summary["tokens_per_second_per_worker"],
        "compute_utilization": summary["compute_utilization"],
        "sync_seconds_per_region": (sum(summary["sync_seconds"].values()) / len(summary["sync_seconds"])
                                    if mode == "diloco" else 0.0),
        "wall_seconds": summary["wall_seconds"],
        "min_regions_in_round": min((r["group_size"] for r in rounds), default=None),
        "regions_agree": summary["regions_agree"],
        "complete": not notes["incomplete"],
        "notes": "; ".join(notes["incomplete"] + notes["events"]) or "ok",
    }


def run_notes(summary: dict[str, Any]) -> dict[str, list[str]]:
    """What makes a run not the clean comparison it should be: regions that left, outer steps averaged
    by fewer than all regions, rounds left inconsistent (incomplete), and worker restarts (events)."""
    incomplete, events = [], []
    if summary["mode"] == "diloco":
        expected = len(summary["regions"])
        reported = summary["comm_bytes_sent"]
        if len(reported) < expected:
            incomplete.append(f"{expected - len(reported)} of {expected} regions left the run")
        for region, rounds in summary.get("rounds", {}).items():
            if len(rounds) < summary["outer_steps"]:
                incomplete.append(f"{region}: {len(rounds)} of {summary['outer_steps']} outer steps")
            for r in rounds:
                if r["group_size"] < expected or not r.get("consistent", True):
                    incomplete.append(f"{region} outer step {r['outer_step'] + 1}: {r['group_size']} of "
                                      f"{expected} regions{'' if r.get('consistent', True) else ', inconsistent'}")
    for event in summary.get("events", []):
        if event.get("event") == "region_departed":
            continue  # counted above
        events.append(f"{event.get('event')} in {event.get('region')} at outer step {event.get('outer_step')}")
    return {"incomplete": incomplete, "events": events}


def curve_of(summary: dict[str, Any]) -> list[dict[str, float]]:
    """Held-out loss against tokens per worker, as summary.json's curve has it: from the start to the end's
    evaluation (the driver closes it with that where the evaluator's fire-and-forget last point missed its read)."""
    return [{"tokens_per_worker": p["tokens_per_worker"], "eval_loss": p["eval_loss"]} for p in summary["eval_curve"]]


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = ("| run | groups | wire | tokens | tokens/worker | held-out loss | perplexity | bytes sent / region "
            "| × DDP | theory b/4/H | tokens/s/worker | wall s | notes |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ratio = "-" if r["bytes_ratio_to_ddp"] is None else f"{r['bytes_ratio_to_ddp']:.4f}"
        lines.append(
            f"| {r['run']} | {r['groups']} | {r['compression']} | {r['tokens']:,} | {r['tokens_per_worker']:,} "
            f"| {r['eval_loss_at_start']:.3f} → {r['eval_loss']:.3f} | {r['eval_perplexity']:.1f} "
            f"| {_human_bytes(r['bytes_sent_per_region'])} | {ratio} | {r['expected_bytes_ratio']:.4f} "
            f"| {r['tokens_per_second_per_worker']:,.0f} | {r['wall_seconds']:.0f} | {r['notes']} |")
    return "\n".join(lines)


def plot_curves(curves: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"ddp": "s-", "diloco-none": "o-", "diloco-fp16": "^--", "diloco-scaled-fp16": "v-.",
              "single": "d:"}
    for label, points in curves.items():
        ax.plot([p["tokens_per_worker"] for p in points], [p["eval_loss"] for p in points],
                styles.get(label, "o-"), label=label)
    ax.set_xlabel("tokens per worker (after the warm start)")
    ax.set_ylabel("held-out loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


@contextlib.contextmanager
def ray_session(address: str | None, workers: int):
    """A fresh local Ray for one run, shut down after it: actors one run leaves behind (its Evaluator,
    Ray Train controllers, Ray Data coordinators: ~0.5 GB each) cannot crowd the next run's memory.
    An existing cluster (`--address`, RAY_ADDRESS, or a Ray the caller started) is used as it is."""
    import ray

    if ray.is_initialized() or address or os.environ.get("RAY_ADDRESS"):
        yield
        return
    # Logical CPUs for every worker, SyncActor, the Evaluator and Ray Data tasks of the largest arm
    # (4 regions: 4 workers + 4 SyncActors + 1 Evaluator); they take turns on the real cores.
    # address="local": a cluster of our own, even when `ray start` left one running on this machine.
    for attempt in range(1, 4):
        try:
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2 * workers + 4), include_dashboard=False)
            break
        except Exception as error:  # on a loaded machine the raylet can miss Ray's 30 s start-up deadline
            ray.shutdown()
            if attempt == 3:
                raise
            print(f"[compare] Ray did not start ({error}); trying again", file=sys.stderr, flush=True)
            time.sleep(10 * attempt)
    try:
        yield
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    from ray_diloco.driver import run_training  # Ray and torch: only once the arguments are good (seconds)

    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    base = base_config(args)
    print(f"[compare] warm start: {args.warmup_steps} steps, mode single", flush=True)
    # The arms' directories are this benchmark's own: each invocation starts them afresh (a run found under
    # its name would otherwise be continued, or refused if the flags changed).
    arms = chosen_arms(args.arms)
    for label in ("warm-start", *(label for label, _, _ in ARMS)):
        shutil.rmtree(out / ARMS_DIR / label, ignore_errors=True)
    with ray_session(args.address, args.workers):
        warm = run_training(warm_start_config(base, args.warmup_steps), address=args.address)
    init_from = str(out / ARMS_DIR / "warm-start" / "model")
    summaries: dict[str, dict] = {}
    for label, mode, compression in arms:
        print(f"[compare] {label}: mode {mode}, wire {compression}, {base.total_inner_steps} steps per worker",
              flush=True)
        cfg = arm_config(base, label, mode, compression, init_from, args.baseline_eval_steps)
        with ray_session(args.address, args.workers):
            summaries[label] = run_training(cfg, address=args.address)

    ddp_sent = summaries["ddp"]["comm_bytes_sent"]
    ddp_per_worker = sum(ddp_sent.values()) / len(ddp_sent)
    rows = [row_of(label, summaries[label], ddp_per_worker) for label, _, _ in arms]
    curves = {label: curve_of(summaries[label]) for label, _, _ in arms}
    total_seconds = time.perf_counter() - started
    settings = {
        "workers": args.workers, "inner_steps": args.inner_steps, "outer_steps": args.outer_steps,
        "steps_per_worker": base.total_inner_steps, "warmup_steps": args.warmup_steps,
        "baseline_eval_steps": args.baseline_eval_steps, "seq_len": base.data.seq_len,
        "batch_size": base.data.batch_size, "eval_windows": base.data.eval_windows, "seed": args.seed,
        "data": args.data or "bundled C4 sample", "eval_data": args.eval_data or "bundled C4 held-out shard",
        "parameters": summaries["ddp"]["parameters"], "inner": dataclasses.asdict(base.inner),
        "outer": {k: v for k, v in dataclasses.asdict(base.outer).items() if k in ("lr", "momentum", "nesterov")},
        "argv": list(sys.argv[1:] if argv is None else argv),
    }
    result = {"settings": settings, "machine": machine_info(), "total_seconds": round(total_seconds, 1),
              "warm_start": {"steps": args.warmup_steps, "eval_loss": warm["eval_loss"],
                             "eval_loss_at_start": warm["eval_loss_at_start"],
                             "wall_seconds": warm["wall_seconds"], "model": init_from},
              "rows": rows, "curves": curves}
    table = markdown_table(rows)
    plot_path = Path(args.plot).resolve() if args.plot else out / "compare_loss.png"
    title = (f"{args.workers} workers/regions, H={args.inner_steps}, T={args.outer_steps}, "
             f"{settings['parameters'] / 1e6:.1f}M params, warm start {args.warmup_steps} steps")
    plot_curves(curves, plot_path, title)
    result["plot"] = str(plot_path)
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    (out / "compare.md").write_text(
        f"{table}\n\nWarm start: {args.warmup_steps} steps of one worker, held-out loss "
        f"{warm['eval_loss_at_start']:.3f} → {warm['eval_loss']:.3f}. {title}. "
        f"Total {total_seconds:.0f} s.\n")
    print(table)
    print(f"[compare] {total_seconds:.0f} s in all; wrote {out / 'compare.json'}, {out / 'compare.md'}, "
          f"{plot_path}", flush=True)
    bad = [r["run"] for r in rows if not r["complete"] or not math.isfinite(r["eval_loss"])]
    if bad:
        print(f"[compare] NOT a clean comparison: {bad} (see the notes column)", file=sys.stderr, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
