"""The cross-region all-reduce against its byte floor: M regions average N MB of fp32 pseudo-gradient.

    python benchmarks/allreduce.py                          # 100 MB, 2 and 4 regions, loopback (~2 min)
    python benchmarks/allreduce.py --regions 2 --wan-mbit 100   # under a 100 Mbit/s link (root, tc)
    python benchmarks/allreduce.py --regions 2 --secret both    # the cost of the run's secret (signed records,
                                                                # members-only groups), in one run

Each region is a process of its own with a `RegionAverager` (ray_diloco.sync.averaging: the SyncActor's,
Hivemind DHT + the exact all-reduce, `--compression` on the wire) listening on a fixed port; they meet through
the first one's DHT address (with `--secret on`: signed and checked records, and each region's record naming its
peer ID, as a SyncActor's state record does, so that only members join a group; ray_diloco.sync.auth), then run `--rounds` rounds from a common barrier, `--gap-seconds` apart (the
inner steps between two rounds, not timed: what a region prepares between rounds is off the critical path).
Per configuration it prints the median round and its split (averager start-up, matchmaking, all-reduce =
transfer + decode, shutdown), the bytes each region sent, and the byte floor: the most bytes one region sent
÷ the link rate measured by one TCP stream just before (loopback, or the `tc`-shaped link of
`ray_diloco.sync.wan_emulation`). The ratio round ÷ floor is what the all-reduce costs beyond moving its
bytes (1.0: nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import sys
import time

import torch
from hivemind.utils import get_dht_time

from ray_diloco.cli import OneLineErrors
from ray_diloco.sync.averaging import RegionAverager
from ray_diloco.sync.state_sharing import state_key
from ray_diloco.sync.wan_emulation import Link, ShapedPorts, ShapingError, check_can_shape, verify_link

BASE_PORT = 46100
RUN = "allreduce-bench"
SECRET = b"benchmark-secret-" * 2


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="allreduce.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0, help="fp32 megabytes of Δ per region (default 100)")
    parser.add_argument("--regions", default="2,4", help="comma-separated region counts (default 2,4)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per configuration (default 3)")
    parser.add_argument("--compression", default="scaled-fp16", help="wire codec (default scaled-fp16)")
    parser.add_argument("--matchmaking-seconds", type=float, default=5.0, help="default 5")
    parser.add_argument("--gap-seconds", type=float, default=3.0,
                        help="between rounds, where the inner steps would run (default 3; not timed)")
    parser.add_argument("--part-kb", type=int, default=512, help="all-reduce message part size (default 512)")
    parser.add_argument("--secret", choices=["off", "on", "both"], default="off",
                        help="the run's secret: off (default), on, or both (each configuration twice, and the ratio)")
    parser.add_argument("--wan-mbit", type=float, default=0.0,
                        help="shape the regions' ports to this rate (root and tc; 0: loopback, the default)")
    return parser


def region_process(index: int, regions: int, args: argparse.Namespace, signed: bool, peers, barrier,
                   results) -> None:
    torch.set_num_threads(1)
    initial = None if index == 0 else peers.get(timeout=60)
    averager = RegionAverager(
        run_id=RUN, region=f"r{index}", expected_regions=regions, compression=args.compression,
        initial_peers=initial, port=BASE_PORT + index, matchmaking_seconds=args.matchmaking_seconds,
        part_size_bytes=args.part_kb * 1024,
        averaging_timeout=max(120.0, 20 * args.mb * 8 / max(args.wan_mbit, 1.0)),
        secret=SECRET if signed else None, members_key=state_key(RUN) if signed else None)
    if signed:  # what makes a region a member: a signed record naming its peer ID
        averager.dht.store(state_key(RUN), subkey=f"r{index}", value={"peer_id": averager.dht.peer_id.to_base58()},
                           expiration_time=get_dht_time() + 3600)
    if index == 0:
        for _ in range(regions - 1):
            peers.put(averager.visible_multiaddrs())
    numel = int(args.mb * 1e6 / 4)
    delta = {"delta": torch.randn(numel, generator=torch.Generator().manual_seed(index)) * 1e-3}
    for round_index in range(args.rounds):
        time.sleep(args.gap_seconds if round_index else 0.0)  # the H inner steps between two rounds
        barrier.wait()
        result = averager.average(delta, weight=1.0, round_index=round_index)
        results.put((index, round_index, result.seconds, result.group_size, result.bytes_sent,
                     dict(result.timings)))
    barrier.wait()
    averager.shutdown()


def run_config(regions: int, args: argparse.Namespace, rate_mbit: float, signed: bool) -> dict:
    ctx = mp.get_context("fork")  # as in a Ray worker: the averager forks its own child process
    peers, results, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(regions)
    processes = [ctx.Process(target=region_process, args=(i, regions, args, signed, peers, barrier, results))
                 for i in range(regions)]
    for process in processes:
        process.start()
    try:
        rows = [results.get(timeout=600) for _ in range(regions * args.rounds)]
    finally:  # a region that failed leaves the others waiting at the barrier
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    if any(row[3] != regions for row in rows):
        raise RuntimeError(f"a round did not gather all {regions} regions: {[row[3] for row in rows]}")
    by_round = [[row for row in rows if row[1] == r] for r in range(args.rounds)]
    seconds = [max(row[2] for row in round_rows) for round_rows in by_round]  # a round ends with its last region
    timing = lambda key: statistics.median(row[5].get(key, 0.0) for row in rows)  # noqa: E731
    sent = max(row[4] for row in rows)
    floor = sent * 8 / (rate_mbit * 1e6)
    median = statistics.median(seconds)
    return {"regions": regions, "seconds": median, "startup": timing("startup"), "shutdown": timing("shutdown"),
            "allreduce": timing("allreduce"), "matchmaking": timing("step") - timing("allreduce"),
            "sent_mb": sent / 1e6, "floor": floor, "ratio": median / floor}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        counts = [int(n) for n in args.regions.split(",")]
    except ValueError:
        parser.error(f"--regions takes comma-separated region counts (2 or more), got {args.regions!r}")
    if min(counts) < 2:
        parser.error(f"--regions takes comma-separated region counts (2 or more), got {args.regions!r}")
    if args.wan_mbit and max(counts) > 2:
        parser.error("--wan-mbit shapes one link per region port, which is one link each way only between 2 "
                     "regions: use --regions 2")
    link = Link(args.wan_mbit) if args.wan_mbit else None
    ports = [BASE_PORT + i for i in range(max(counts))]
    try:
        if link:
            check_can_shape(link)  # before anything starts: root, tc
    except ShapingError as error:
        print(f"allreduce.py: error: --wan-mbit: {error}", file=sys.stderr)
        return 2
    with ShapedPorts(ports, link) if link else contextlib.nullcontext():
        measure(args, counts, ports, link)
    return 0


def measure(args: argparse.Namespace, counts: list[int], ports: list[int], link: Link | None) -> None:
    check = verify_link(ports[0], seconds=1.0, rate_mbit=args.wan_mbit or 10000)
    label = link.label() if link else "loopback"
    print(f"# {label}: {check.line(link) if link else f'one TCP stream {check.rate_mbit:.0f} Mbit/s'}")
    print(f"# {args.mb:g} MB fp32 per region, {args.compression} on the wire, {args.rounds} rounds, "
          f"matchmaking {args.matchmaking_seconds:g} s")
    print("| regions | secret | link | round s | start-up | matchmaking | all-reduce | shutdown | MB sent | floor s "
          "| ÷ floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.secret]
    for regions in counts:
        rows = {}
        for signed in modes:
            started = time.time()
            row = rows[signed] = run_config(regions, args, check.rate_mbit, signed)
            print(f"| {regions} | {'on' if signed else 'off'} | {label} | {row['seconds']:.2f} | {row['startup']:.2f} "
                  f"| {row['matchmaking']:.2f} | {row['allreduce']:.2f} | {row['shutdown']:.2f} "
                  f"| {row['sent_mb']:.1f} | {row['floor']:.3f} | {row['ratio']:.1f} |", flush=True)
            print(f"#   ({time.time() - started:.0f} s wall)", file=sys.stderr)
        if len(rows) == 2:
            print(f"# {regions} regions: round with the secret ÷ without: {rows[True]['seconds'] / rows[False]['seconds']:.3f}"
                  f" (all-reduce {rows[True]['allreduce'] / rows[False]['allreduce']:.3f})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
