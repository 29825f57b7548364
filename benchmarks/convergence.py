"""Which outer method reaches the lowest held-out loss for the bytes it sends: a grid of arms, long enough to rank.

    python benchmarks/convergence.py                          # the whole grid: many hours on 2 CPU cores
    python benchmarks/convergence.py --arms 'ddp,single,*-h50' --steps 2000
    python benchmarks/convergence.py --write-docs             # the table and plots into docs/ as well

Every arm is one `ray-diloco train` process (the CLI, as a user runs it) from scratch on the tiny-cpu model, with
the same data, seed and inner AdamW, and the same number of inner steps (so the same tokens) per worker:

* `ddp` (`--workers` workers, a gradient all-reduce every step) and `single` (one worker);
* `diloco-m{1,2,4}-{fp32,sfp16}-h{H}`: M regions of one worker, dense DiLoCo, fp32 or scaled-fp16 on the wire;
* `diloco-m1-w{W}-sfp16-h{H}`: one region of `--workers` workers (FSDP2), an outer step every H: DDP's tokens and
  global batch, the comparison of the DiLoCo scaling-law paper's M = 1 (the arms above train one worker per region);
* `sparseloco-{1,3}pct-h{H}`: SparseLoCo, top 41 or 128 of every 4096 values at 2 bits, M = `--workers`;
* `dct-k{2,4}-h{H}`: the decoupled-momentum DCT method, top 2 or 4 of every 64 coefficients, M = `--workers`;
* `*-s{seed}`: the headline arms again with the next seed (`--seeds 1` alone runs every arm with seed 1).

Arms run in the order above, headline arms first, so a grid stopped early still compares the methods. It resumes:
an arm with a summary.json of a run to its end is done and read back; an arm that was interrupted or stopped
(Ctrl-C: the arm's CLI stops at its next outer step, and a second Ctrl-C forces it) continues from its last
checkpoint (`--resume`; the table's wall time adds up its invocations, `<arm>.seconds`); an arm begun with
other settings than this invocation's (its config.yaml says) is refused, and another --output-dir is the fix;
only `--arms` (glob patterns) are run. After every arm it rewrites `convergence.json`,
`convergence.md` (held-out loss, bytes sent per round, bits per parameter per round, × DDP bytes, wall time) and
two plots: held-out loss against tokens per worker, and final loss against bytes sent (the Pareto picture).
Tuning is not done here: `tune.py` tunes the outer lr on a validation split, never on the held-out set.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # compare.py, beside this file
from compare import curve_of, machine_info  # noqa: E402

from ray_diloco.cli import OneLineErrors  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT_DIR = "runs/convergence"
DOCS_BEGIN, DOCS_END = "<!-- convergence:begin -->", "<!-- convergence:end -->"


@dataclass(frozen=True)
class Arm:
    label: str
    mode: str  # diloco, ddp, single
    regions: int
    method: str = "diloco"
    compression: str = "none"
    inner_steps: int = 50  # H (ddp and single: how often they are evaluated)
    workers_per_region: int = 1  # diloco: each region's FSDP2 group
    flags: tuple[str, ...] = ()  # more CLI flags (tune.py: the outer lr, the validation split)
    topk: int = 0
    seed: int = 0
    warmup_steps: int | None = None  # the inner lr's warm-up (None: the preset's; tune.py sweeps it)


def grid(workers: int, hs: list[int], seeds: list[int]) -> list[Arm]:
    """Every arm, headline first (a grid stopped early still compares the methods)."""
    first, rest = hs[0], hs[1:]
    arms = [Arm("ddp", "ddp", workers, inner_steps=first), Arm("single", "single", 1, inner_steps=first)]

    def methods(h: int) -> list[Arm]:
        return [Arm(f"diloco-m{workers}-sfp16-h{h}", "diloco", workers, compression="scaled-fp16", inner_steps=h),
                Arm(f"sparseloco-1pct-h{h}", "diloco", workers, "sparseloco", inner_steps=h, topk=41),
                Arm(f"dct-k2-h{h}", "diloco", workers, "dct", inner_steps=h, topk=2)]

    def others(h: int) -> list[Arm]:
        dense = [Arm(f"diloco-m{m}-{tag}-h{h}", "diloco", m, compression=codec, inner_steps=h)
                 for m in sorted({1, 2, workers}) for tag, codec in (("fp32", "none"), ("sfp16", "scaled-fp16"))
                 if (m, tag) != (workers, "sfp16")]
        if workers > 1:  # M = 1 at DDP's global batch
            dense.append(Arm(f"diloco-m1-w{workers}-sfp16-h{h}", "diloco", 1, compression="scaled-fp16",
                             inner_steps=h, workers_per_region=workers))
        return dense + [Arm(f"sparseloco-3pct-h{h}", "diloco", workers, "sparseloco", inner_steps=h, topk=128),
                        Arm(f"dct-k4-h{h}", "diloco", workers, "dct", inner_steps=h, topk=4)]

    arms += methods(first) + others(first)
    for h in rest:
        arms += methods(h) + others(h)
    headline = arms[:5]
    arms = [with_seed(a, seeds[0]) for a in arms]
    for seed in seeds[1:]:
        arms += [with_seed(a, seed) for a in headline]
    return arms


def with_seed(arm: Arm, seed: int) -> Arm:
    """The arm with this seed, which its label names unless it is 0: two seeds of one arm never share a directory
    (`--seeds 1` alone once read back the seed-0 runs and reported them as seed 1)."""
    return dataclasses.replace(arm, label=f"{arm.label}-s{seed}" if seed else arm.label, seed=seed)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="convergence.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="inner steps per worker of every arm (default 2000)")
    parser.add_argument("--h", default="50,100", help="DiLoCo's H values, comma-separated (default 50,100)")
    parser.add_argument("--workers", type=int, default=4, help="DDP workers = regions of the compressed arms (4)")
    parser.add_argument("--seeds", default="0,1", help="seeds; the headline arms run with each (default 0,1)")
    parser.add_argument("--batch-size", type=int, default=3, help="windows per step per worker (default 3)")
    parser.add_argument("--evals", type=int, default=10, help="held-out evaluations per arm (default 10)")
    parser.add_argument("--arms", default="*", help="glob patterns of the arms to run, comma-separated (default *)")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the table into docs/benchmarks.md and the plots into docs/")
    parser.add_argument("--list", action="store_true", help="print the arms and exit")
    return parser


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[int], list[int]]:
    try:
        hs, seeds = [int(v) for v in args.h.split(",")], [int(v) for v in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--h and --seeds take comma-separated integers, got {args.h!r}, {args.seeds!r}")
    bad = [f"--h {h} must divide --steps {args.steps}" for h in hs if h < 1 or args.steps % h]
    for flag, values, given in (("--h", hs, args.h), ("--seeds", seeds, args.seeds)):
        if len(set(values)) < len(values):  # one label each: a second would only read the first back
            bad.append(f"{flag} {given}: give each value once")
    bad += [f"--{name.replace('_', '-')} must be >= 1" for name in ("workers", "batch_size", "evals", "steps")
            if getattr(args, name) < 1]
    if bad:
        parser.error("; ".join(bad))
    return hs, seeds


def arm_config(arm: Arm, args: argparse.Namespace) -> dict:
    """The YAML the arm's CLI call reads for what no flag sets."""
    rounds = args.steps // arm.inner_steps
    run = {"eval_every": max(1, rounds // args.evals)}
    if arm.mode == "diloco":  # checkpoints (and so --resume) are DiLoCo's: a baseline arm interrupted starts again
        run["checkpoint_every"] = max(1, rounds // 4)
    inner = {} if arm.warmup_steps is None else {"inner": {"warmup_steps": arm.warmup_steps}}
    return {"data": {"batch_size": args.batch_size}, **inner,
            # Matchmaking waits for every region (a round starts once all are in): the long bound only keeps
            # regions that share 2 busy cores from averaging in part-groups. It changes no numerics.
            "outer": {"matchmaking_seconds": 120.0, "averaging_timeout": 300.0}, "run": run}


def command(arm: Arm, args: argparse.Namespace, arms_dir: Path, resume: bool) -> list[str]:
    flags = ["--config", str(arms_dir / f"{arm.label}.yaml"), "--run-name", arm.label, "--output-dir",
             str(arms_dir), "--mode", arm.mode, "--regions", str(arm.regions if arm.mode != "single" else 1),
             "--workers-per-region", str(arm.workers_per_region), "--inner-steps", str(arm.inner_steps),
             "--outer-steps", str(args.steps // arm.inner_steps), "--seed", str(arm.seed),
             "--compression", arm.compression]
    if arm.mode == "ddp":  # one group of `regions` workers
        flags[flags.index("--regions") + 1], flags[flags.index("--workers-per-region") + 1] = "1", str(arm.regions)
    if arm.method != "diloco":
        flags += ["--outer-method", arm.method, "--topk", str(arm.topk)]
    return [sys.executable, "-m", "ray_diloco.cli", "train", *flags, *arm.flags] + (["--resume"] if resume else [])


def region_checkpoints(root: Path, label: str) -> list[list[int]]:
    """The committed outer steps of each region of an arm (a run killed while writing its first checkpoint leaves a
    directory without one). Beside the regions' directories lie their workers' Ray Train runs, `<run>-<region>/`."""
    from ray_diloco.checkpoint import CheckpointStore

    regions = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(f"{label}-")] if root.is_dir() else []
    return [CheckpointStore(str(d)).steps() for d in regions]


def run_arm(arm: Arm, args: argparse.Namespace, arms_dir: Path) -> dict | None:
    """The arm's summary: read back if it ran to its end before, else run (continued from its checkpoints if it
    began, or was stopped). An arm begun with other settings is refused: continued or read back, it would mix or
    misname two runs (the CLI itself lets a continued run change its outer steps, worker counts and outer lr)."""
    summary_path = arms_dir / arm.label / "summary.json"
    steps = region_checkpoints(arms_dir / arm.label / "checkpoints", arm.label)
    begun = summary_path.exists() or any(steps)  # the CLI continues from any region's checkpoints
    if begun and (differences := settings_differ(arm, args, arms_dir)):
        print(f"[convergence] {arm.label}: {arms_dir / arm.label} holds a run with other settings ({differences}):"
              f" give another --output-dir", file=sys.stderr, flush=True)
        return None
    if begun and (done := summary_to_its_end(summary_path)) is not None:  # its settings were checked above
        return done
    (arms_dir / f"{arm.label}.yaml").write_text(yaml.safe_dump(arm_config(arm, args)))
    resume = bool(steps) and all(steps)  # else it starts again (a region without a checkpoint cannot continue)
    log = arms_dir / f"{arm.label}.log"
    print(f"[convergence] {arm.label}: {'continuing' if resume else 'starting'} ({log})", flush=True)
    seconds = arms_dir / f"{arm.label}.seconds"  # each invocation's wall time, a line each (summary.json: the last's)
    if not resume:
        seconds.unlink(missing_ok=True)  # started again: the earlier invocations' time trained nothing kept
    started = time.perf_counter()
    try:
        with log.open("a") as handle:
            code = run_to_its_end(command(arm, args, arms_dir, resume), handle)
    finally:  # a stopped invocation's time counts too: the next continues from its checkpoints
        with seconds.open("a") as handle:
            handle.write(f"{time.perf_counter() - started:.1f}\n")
    done = finished_summary(arm, args, arms_dir)
    if code != 0 or done is None:
        print(f"[convergence] {arm.label} failed or stopped (exit {code}); see {log}", file=sys.stderr, flush=True)
    return done


def run_to_its_end(cmd: list[str], log) -> int:
    """The arm's CLI, waited for. Ctrl-C reaches it too (the terminal signals the whole process group): it then ends
    at its next outer step with a checkpoint and a summary (`stopped`; the next invocation continues it), which is
    waited for here; a second Ctrl-C forces it (the CLI's rule), and this kills it. Then the grid ends. (A plain
    `subprocess.call` killed the CLI 0.25 s after the first Ctrl-C: everything since its last checkpoint was lost.)"""
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        return process.wait()
    except KeyboardInterrupt:
        print("[convergence] stopping: the arm ends at its next outer step with a checkpoint (Ctrl-C again: now)",
              file=sys.stderr, flush=True)
        try:
            process.wait()
        except KeyboardInterrupt:
            process.kill()
            process.wait()
        raise


def finished_summary(arm: Arm, args: argparse.Namespace, arms_dir: Path) -> dict | None:
    """The summary of the arm's run if it ran to its end with the settings asked for (not stopped part-way, nor
    cut short while it was written)."""
    summary = summary_to_its_end(arms_dir / arm.label / "summary.json")
    return None if summary is None or settings_differ(arm, args, arms_dir) else summary


def summary_to_its_end(path: Path) -> dict | None:
    """The summary at `path` of a run that ended (None: none, stopped part-way, or cut short while written)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return None if summary.get("stopped") else summary


COMPARED = (("run", "mode"), ("run", "seed"), ("run", "outer_steps"), ("outer", "inner_steps"),
            ("outer", "method"), ("outer", "compression"), ("outer", "topk"), ("outer", "lr"), ("data", "batch_size"))
SECTIONS = sorted({section for section, _ in COMPARED})


def settings_differ(arm: Arm, args: argparse.Namespace, arms_dir: Path) -> str:
    """Where the run in the arm's directory differs from the arm asked for (the directory reused with other
    --seeds, --steps, --workers or --batch-size): reading it back would report another run's numbers under this
    arm's, continuing it would mix two. "" where they agree."""
    from ray_diloco.cli import build_parser, resolve_config

    path = arms_dir / arm.label / "config.yaml"
    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        return f"{path.name} unreadable: {type(error).__name__}"
    if not isinstance(saved, dict) or not all(isinstance(saved.get(section, {}), dict) for section in SECTIONS):
        return f"{path.name} is not a run configuration"
    with tempfile.TemporaryDirectory() as scratch:  # the configuration this invocation would run the arm with
        (Path(scratch) / f"{arm.label}.yaml").write_text(yaml.safe_dump(arm_config(arm, args)))
        argv = command(arm, args, Path(scratch), resume=False)[3:]  # after "python -m ray_diloco.cli"
        wanted = resolve_config(build_parser().parse_args(argv)).to_dict()

    def settings(cfg: dict) -> dict[str, object]:
        values = {f"{section}.{key}": (cfg.get(section) or {}).get(key, "missing") for section, key in COMPARED}
        regions = cfg.get("regions") if isinstance(cfg.get("regions"), list) else []
        values["regions"] = [(r.get("name"), r.get("workers")) if isinstance(r, dict) else r for r in regions]
        return values

    saved_values, wanted_values = settings(saved), settings(wanted)
    return ", ".join(f"{name} {saved_values[name]!r}, not {value!r}" for name, value in wanted_values.items()
                     if saved_values[name] != value)


def wall_seconds(arm: Arm, summary: dict, arms_dir: Path) -> float:
    """The arm's wall time: its invocations' (`<arm>.seconds`, written by run_arm), else its summary's (an arm run
    before that file, or read back from a directory without it)."""
    seconds = arms_dir / f"{arm.label}.seconds"
    recorded = [float(line) for line in seconds.read_text().split()] if seconds.exists() else []
    return sum(recorded) if recorded else summary["wall_seconds"]


def row_of(arm: Arm, summary: dict, ddp_per_round: float | None, wall: float) -> dict:
    rounds = [r for per_region in summary.get("rounds", {}).values() for r in per_region if r["group_size"] > 1]
    per_round = sum(r["bytes_sent"] for r in rounds) / len(rounds) if rounds else 0.0
    if arm.mode == "ddp":  # per worker, per H steps: what DDP sends in the time DiLoCo sends once
        per_round = sum(summary["comm_bytes_sent"].values()) / len(summary["comm_bytes_sent"]) / (
            summary["outer_steps"])
    bits = summary.get("bits_per_parameter_per_round") or {}
    known = [b for b in bits.values() if b is not None]
    return {"arm": arm.label, "mode": arm.mode, "regions": arm.regions, "method": arm.method, "H": arm.inner_steps,
            "topk": arm.topk, "seed": arm.seed, "eval_loss": summary["eval_loss"],
            "eval_loss_at_start": summary["eval_loss_at_start"], "tokens": summary["tokens"],
            "bytes_per_round": per_round,
            "bits_per_parameter": (sum(known) / len(known) if known
                                   else 8 * per_round / summary["parameters"]),
            "times_ddp_bytes": per_round / ddp_per_round if ddp_per_round and arm.mode != "single" else None,
            "wall_seconds": wall, "regions_agree": summary.get("regions_agree"),
            "curve": curve_of(summary), "total_bytes": sum(summary["comm_bytes_sent"].values())}


def markdown(rows: list[dict], settings: dict) -> str:
    lines = ["| arm | M | H | held-out loss | bytes / round / region | bits / param / round | × DDP bytes | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["times_ddp_bytes"] is None else f"{r['times_ddp_bytes']:.4f}"
        lines.append(f"| {r['arm']} | {r['regions']} | {r['H'] if r['mode'] == 'diloco' else '-'} "
                     f"| {r['eval_loss_at_start']:.3f} → {r['eval_loss']:.4f} | {r['bytes_per_round']:,.0f} "
                     f"| {r['bits_per_parameter']:.3f} | {ratio} | {r['wall_seconds']:.0f} |")
    command = " ".join(command_for(settings["argv"], [r["arm"] for r in rows]))
    return "\n".join(lines) + (f"\n\n{settings['steps']} inner steps per worker, batch {settings['batch_size']}"
                               f" × 128 tokens, tiny-cpu model, from scratch. `python benchmarks/convergence.py "
                               f"{command}` (each arm resumable: a grid run in several invocations reads back the "
                               "arms already done)\n")


def command_for(argv: list[str], arms: list[str]) -> list[str]:
    """The invocation that gives every row of the table: this one's flags with --arms naming all of them (a grid
    is often run an arm or two at a time; the table holds every arm done so far)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--arms":
            skip = True
        elif not arg.startswith("--arms="):
            kept.append(arg)
    return kept + ["--arms", ",".join(arms)]


def plot(rows: list[dict], loss_png: Path, pareto_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in rows:
        ax.plot([p["tokens_per_worker"] for p in r["curve"]], [p["eval_loss"] for p in r["curve"]], "-",
                label=r["arm"], linewidth=1)
    ax.set(xlabel="tokens per worker", ylabel="held-out loss", title="held-out loss against tokens")
    ax.grid(alpha=0.3), ax.legend(fontsize=6, ncol=2)
    fig.tight_layout(), fig.savefig(loss_png, dpi=120), plt.close(fig)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in (r for r in rows if r["total_bytes"] > 0):
        ax.scatter(r["total_bytes"], r["eval_loss"], s=18)
        ax.annotate(r["arm"], (r["total_bytes"], r["eval_loss"]), fontsize=6)
    ax.set(xscale="log", xlabel="bytes sent in the run (all regions / workers)", ylabel="final held-out loss",
           title="final loss against bytes sent")
    ax.grid(alpha=0.3)
    fig.tight_layout(), fig.savefig(pareto_png, dpi=120), plt.close(fig)


def write_results(rows: list[dict], settings: dict, out: Path, write_docs: bool) -> None:
    table = markdown(rows, settings)
    (out / "convergence.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    (out / "convergence.md").write_text(table)
    plot(rows, out / "convergence_loss.png", out / "convergence_pareto.png")
    if write_docs:
        plot(rows, ROOT / "docs" / "convergence_loss.png", ROOT / "docs" / "convergence_pareto.png")
        docs = ROOT / "docs" / "benchmarks.md"
        text = docs.read_text()
        section = f"{DOCS_BEGIN}\n{table}{DOCS_END}"
        if DOCS_BEGIN in text:
            text = text[:text.index(DOCS_BEGIN)] + section + text[text.index(DOCS_END) + len(DOCS_END):]
        else:
            text += f"\n## Convergence of the outer methods (benchmarks/convergence.py)\n\n{section}\n"
        docs.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    hs, seeds = check(args, parser)
    patterns = [p.strip() for p in args.arms.split(",") if p.strip()]
    every = grid(args.workers, hs, seeds)
    arms = [a for a in every if any(fnmatch.fnmatch(a.label, p) for p in patterns)]
    if not arms:
        parser.error(f"--arms {args.arms!r} names no arm (--list prints them)")
    if args.list:
        print("\n".join(a.label for a in arms))
        return 0
    out = Path(args.output_dir).resolve()
    arms_dir = out / "arms"
    arms_dir.mkdir(parents=True, exist_ok=True)
    settings = {"steps": args.steps, "batch_size": args.batch_size, "workers": args.workers, "h": hs,
                "seeds": seeds, "argv": list(sys.argv[1:] if argv is None else argv), "machine": machine_info()}
    # The table holds every finished arm of the grid in this directory, whichever invocation ran it.
    # An arm run with other settings, or stopped part-way, is left out (run_arm says so, or continues it, should this
    # invocation ask for it).
    summaries = {a.label: done for a in every if (done := finished_summary(a, args, arms_dir)) is not None}
    failed, started = [], time.perf_counter()
    for arm in arms:
        try:
            summary = run_arm(arm, args, arms_dir)
        except KeyboardInterrupt:  # the arm has ended (stopped, with a checkpoint, or forced)
            print(f"[convergence] stopped at {arm.label}: the same command continues the grid", file=sys.stderr)
            return 130
        if summary is None:
            failed.append(arm.label)
            continue
        summaries[arm.label] = summary
        ddp = summaries.get("ddp")
        ddp_per_round = (sum(ddp["comm_bytes_sent"].values()) / len(ddp["comm_bytes_sent"]) / ddp["outer_steps"]
                         if ddp else None)
        rows = [row_of(a, summaries[a.label], ddp_per_round, wall_seconds(a, summaries[a.label], arms_dir))
                for a in every if a.label in summaries]
        write_results(rows, settings, out, args.write_docs)
    print(f"[convergence] {len(arms) - len(failed)} of {len(arms)} arms in {time.perf_counter() - started:.0f} s; "
          f"{out / 'convergence.md'}", flush=True)
    bad = failed + [a.label for a in arms
                    if a.label in summaries and not math.isfinite(summaries[a.label]["eval_loss"])]
    if bad:
        print(f"[convergence] failed or diverged: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
