"""Compute utilization of a 2-region DiLoCo run under emulated WAN links, blocking and overlapped outer steps.

    sudo python benchmarks/wan.py                   # 1000, 100, 50, 20 Mbit/s x {blocking, overlapped}, ~25 min
    sudo python benchmarks/wan.py --links 100/25,20/50/0.1 --outer-steps 6     # delay and loss need netem

Each cell runs two clusters, as a multi-region deployment does: `ray-diloco train --local-regions r0` and
`... r1`, each with a private Ray, the tiny model, H inner steps per round, Hivemind on a fixed port per region
(`outer.port`) whose traffic, and only that, goes through the link `ray_diloco.sync.wan_emulation` shapes with
`tc` (a link each way per port; rate by HTB, delay/jitter/loss by netem where the kernel has it). The link is
verified before each cell by timing a transfer and a ping-pong over it. Per cell it prints:
* compute utilization measured: 1 − time the workers waited on outer steps ÷ time in the training loop, from the
  end of the first exchange (the first round also waits for the other cluster to start; the run's whole-loop
  `compute_utilization`, which includes that, is in the JSON), mean of the two regions; and the same without
  the last round (it blocks in both modes, and overlapped it waits for all the lead the faster region built);
* predicted by the analytic model papers use: C = H × the run's median inner step; S = bytes one region sent
  per round ÷ link rate + one round trip; blocking C / (C + S), overlapped C / max(C, S);
* the sync: mean seconds the workers waited per round, that wait ÷ C (the measured share of a sync: the
  issue's "link where one blocking sync takes ≈ 10 % of H inner steps" is the blocking cell where it is
  ≈ 0.10), and the round's all-reduce seconds;
* held-out loss at the end (equal steps and data in both modes).
Writes `--output` (a PNG of utilization vs bandwidth) and the table as JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ray_diloco.cli import OneLineErrors
from ray_diloco.presets import tiny_cpu
from ray_diloco.sync.wan_emulation import Link, ShapedPorts, ShapingError, check_can_shape, verify_link

PORTS = {"r0": 46300, "r1": 46301}


def parse_links(text: str) -> list[Link]:
    """'RATE[/ONE_WAY_DELAY_MS[/LOSS_%]]' comma-separated, rates in Mbit/s."""
    links = []
    for spec in text.split(","):
        parts = [float(p) for p in spec.split("/")]
        links.append(Link(rate_mbit=parts[0], delay_ms=parts[1] if len(parts) > 1 else 0.0,
                          loss_percent=parts[2] if len(parts) > 2 else 0.0))
    return links


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="wan.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", default="1000,100,50,20",
                        help="RATE[/DELAY_MS[/LOSS_%%]],... (default 1000,100,50,20)")
    parser.add_argument("--inner-steps", type=int, default=50, metavar="H", help="default 50")
    parser.add_argument("--outer-steps", type=int, default=5, metavar="T", help="default 5")
    parser.add_argument("--seq-len", type=int, default=64, help="default 64")
    parser.add_argument("--batch-size", type=int, default=4, help="default 4")
    parser.add_argument("--work-dir", default="runs/wan")
    parser.add_argument("--output", default="docs/wan_utilization.png")
    return parser


def region_config(args: argparse.Namespace, cell: str, region: str, overlap: bool, work: Path) -> Path:
    cfg = tiny_cpu().to_dict()
    cfg["data"].update(seq_len=args.seq_len, batch_size=args.batch_size)
    cfg["regions"] = [{"name": name, "workers": 1} for name in PORTS]
    cfg["inner"]["warmup_steps"] = 10
    cfg["outer"].update(inner_steps=args.inner_steps, overlap=overlap, port=PORTS[region], matchmaking_seconds=5,
                        max_wait_seconds=300, averaging_timeout=600)
    # A stop must be able to wait out two rounds of these bounds (stopping.check_stop_timeout).
    cfg["run"].update(name=cell, outer_steps=args.outer_steps, checkpoint_every=0, eval_every=0,
                      output_dir=str(work / "out"), checkpoint_path=str(work / "bucket"), stop_timeout_seconds=1800)
    path = work / f"{region}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_cell(args: argparse.Namespace, link: Link, overlap: bool) -> dict:
    cell = f"wan-{link.rate_mbit:g}mbit-{link.delay_ms:g}ms-{'overlapped' if overlap else 'blocking'}"
    work = Path(args.work_dir) / cell
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # each cluster a private Ray
    with ShapedPorts(list(PORTS.values()), link):
        check = verify_link(PORTS["r0"], seconds=1.0, rate_mbit=link.rate_mbit)
        print(f"# {cell}: {check.line(link)}", flush=True)
        started = time.time()
        processes = {region: subprocess.Popen(
            [sys.executable, "-m", "ray_diloco.cli", "train", "--config",
             str(region_config(args, cell, region, overlap, work)), "--local-regions", region],
            stdout=(work / f"{region}.log").open("w"), stderr=subprocess.STDOUT, env=env) for region in PORTS}
        try:
            for region, process in processes.items():
                if process.wait(timeout=3600) != 0:
                    raise RuntimeError(f"{cell}: region {region} failed; see {work / f'{region}.log'}")
        finally:  # one cluster failed or hung: the other does not train on alone
            for process in processes.values():
                if process.poll() is None:
                    process.kill()
    summaries = {r: json.loads((work / "out" / cell / f"summary-{r}.json").read_text()) for r in PORTS}
    return measure(args, link, overlap, check.rtt_ms, summaries, time.time() - started)


def measure(args, link: Link, overlap: bool, rtt_ms: float, summaries: dict, wall: float) -> dict:
    rounds = [r for s in summaries.values() for region, rs in s["rounds"].items() if region in PORTS for r in rs]
    step_tokens = args.seq_len * args.batch_size
    step_seconds = statistics.mean(step_tokens / s["median_step_tokens_per_second_per_worker"]
                                   for s in summaries.values())
    compute = args.inner_steps * step_seconds
    sent = statistics.mean(s["comm_bytes_sent"][r] for r, s in summaries.items()) / args.outer_steps
    sync = sent * 8 / (link.rate_mbit * 1e6) + 2 * link.delay_ms / 1e3
    predicted = compute / max(compute, sync) if overlap else compute / (compute + sync)
    utilization = statistics.mean(s["compute_utilization"] for s in summaries.values())
    steady, middle = [], []
    for region, summary in summaries.items():  # from the end of the first exchange: the clusters' start skew out
        loop = args.inner_steps * args.outer_steps * step_tokens / summary["tokens_per_second_per_worker"]
        (first_end, _), *rest = summary["sync_waits"][region]
        steady.append(1 - sum(wait for _, wait in rest) / (loop - first_end))
        # Without the last round too: it always blocks, and waits for the slower region's whole lead
        (last_end, last_wait), between = rest[-1], rest[:-1]
        middle.append(1 - sum(wait for _, wait in between) / (last_end - last_wait - first_end) if between else 1.0)
    wait = statistics.mean(w for r, s in summaries.items() for _, w in s["sync_waits"][r][1:])
    return {"link": link.label(), "rate_mbit": link.rate_mbit, "mode": "overlapped" if overlap else "blocking",
            "utilization": statistics.mean(steady), "whole_run_utilization": utilization, "predicted": predicted,
            "utilization_without_last_round": statistics.mean(middle),
            "wait_seconds_per_round": wait, "wait_share_of_compute": wait / compute,
            "compute_seconds": compute, "predicted_sync_seconds": sync,
            "all_reduce_seconds": statistics.median(r.get("all_reduce_seconds", 0.0) for r in rounds),
            "eval_loss": statistics.mean(s["eval_loss"] for s in summaries.values()),
            "agree": len({s["exported_digest"] for s in summaries.values()}) == 1,
            "wall_seconds": wall, "rtt_ms": rtt_ms, "bytes_per_round": sent}


def write_png(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    for mode, color in (("blocking", "tab:red"), ("overlapped", "tab:blue")):
        cells = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["rate_mbit"])
        rates = [r["rate_mbit"] for r in cells]
        axes.plot(rates, [r["utilization"] for r in cells], "o-", color=color, label=f"{mode}, measured")
        axes.plot(rates, [r["predicted"] for r in cells], "--", color=color, label=f"{mode}, analytic model")
    axes.set(xscale="log", xlabel="link rate (Mbit/s, each way)", ylabel="compute utilization", ylim=(0, 1.05),
             title="2 regions, tiny model, H inner steps per round, tc-shaped link")
    axes.legend()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if Path(args.output).suffix.lower() != ".png":  # before the runs: a bad name once cost a whole grid's plot
        print(f"wan.py: error: --output {args.output}: give a .png path (the JSON goes beside it)", file=sys.stderr)
        return 2
    try:
        links = parse_links(args.links)
        for link in links:
            check_can_shape(link)  # before any run: root, tc, netem for delays
    except (ValueError, ShapingError) as error:
        print(f"wan.py: error: --links: {error}", file=sys.stderr)
        return 2
    rows = []
    print("| link | mode | utilization measured | predicted | without the last round | whole loop | H steps s "
          "| sync s predicted "
          "| workers' wait s/round | wait ÷ H steps | all-reduce s | held-out loss | regions agree | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for link in links:
        for overlap in (False, True):
            row = run_cell(args, link, overlap)
            rows.append(row)
            print(f"| {row['link']} | {row['mode']} | {row['utilization']:.3f} | {row['predicted']:.3f} | "
                  f"{row['utilization_without_last_round']:.3f} | {row['whole_run_utilization']:.3f} | "
                  f"{row['compute_seconds']:.1f} | {row['predicted_sync_seconds']:.2f} | "
                  f"{row['wait_seconds_per_round']:.2f} | {row['wait_share_of_compute']:.3f} | "
                  f"{row['all_reduce_seconds']:.2f} | {row['eval_loss']:.4f} | "
                  f"{row['agree']} | {row['wall_seconds']:.0f} |", flush=True)
    output = Path(args.output)
    output.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    write_png(rows, output)
    print(f"# wrote {output} and {output.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
