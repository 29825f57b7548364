"""What reading the loss costs per inner step: per step (as the worker did before `StepLog`: an all_reduce of the
loss and a `.item()` after every step) against `StepLog` (one all_reduce and one host sync every 10 steps), on
the worker's own inner step (`ray_diloco.inner_step`: FSDP2 with its mixed precision, AdamW), in one process group.

    python benchmarks/overhead.py --step-log                        # CPU: 2 gloo ranks, tiny-cpu (~1 min)
    python benchmarks/overhead.py --step-log --preset 150m --steps 40   # a GPU: 1 rank, NCCL, bf16

Needs torch and this package only (no Ray: it runs on a GPU machine with torch alone). The token windows are
random ids (the step's cost does not depend on their values). Each variant runs `--repeats` times, alternating,
after warm-up steps; the fastest repeat of each is reported (ms per step, their ratio), and for StepLog the
tokens/s per worker and the MFU (`ray_diloco.metrics.flops_per_token` × tokens/s ÷ the device's bf16 peak).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ray_diloco import metrics
from ray_diloco.inner_step import InnerStep, compile_layers, shard_model
from ray_diloco.model import build_model
from ray_diloco.cli import OneLineErrors
from ray_diloco.presets import PRESETS, get_preset
from ray_diloco.step_log import StepLog

LOG_EVERY = 10


class FixedBatches:
    """`WorkerBatches`' interface over one random batch on the device."""

    def __init__(self, batch: torch.Tensor):
        self.batch = batch

    def next(self) -> torch.Tensor:
        return self.batch


def timed_steps(inner_step, batches, steps: int, variant: str, world: int, device: torch.device) -> float:
    """Seconds for `steps` inner steps with the given way of reading the loss (device work included)."""
    log = StepLog(device, world, LOG_EVERY)
    started = time.perf_counter()
    for step in range(steps):
        loss, tokens = inner_step(batches)
        if variant == "per-step":
            if world > 1:
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            loss.item()
            time.perf_counter()
        elif log.record(step, loss, tokens, 0.0):
            log.flush()
    log.flush()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    cfg = get_preset(args.preset)
    if args.precision:
        cfg = dataclasses.replace(cfg, inner=dataclasses.replace(cfg.inner, precision=args.precision))
    if args.compile is not None:
        cfg = dataclasses.replace(cfg, inner=dataclasses.replace(cfg.inner, compile=args.compile))
    vocab = 50304  # the GPT-2 tokenizer's 50257 rounded up, as resolve_vocab does
    model = build_model(cfg.model, vocab, cfg.data.seq_len, cfg.run.seed)
    if cfg.inner.compile:
        compile_layers(model)
    shard_model(model.to(device), device, world, cfg.inner.precision)
    inner_step = InnerStep(model, cfg, device, 0)
    generator = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, vocab, (cfg.data.batch_size, cfg.data.seq_len), generator=generator).to(device)
    batches = FixedBatches(batch)
    warmup_seconds = timed_steps(inner_step, batches, args.warmup, "step-log", world, device)  # a compile, too
    best = {"per-step": float("inf"), "step-log": float("inf")}
    for _ in range(args.repeats):
        for variant in best:
            best[variant] = min(best[variant], timed_steps(inner_step, batches, args.steps, variant, world, device))
    tokens_per_step = cfg.inner.grad_accum * batch.numel()
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    rate = tokens_per_step * args.steps / best["step-log"]
    results.put({"rank": rank, "device": name, "world": world, "preset": args.preset,
                 "precision": cfg.inner.precision, "compile": cfg.inner.compile, "warmup_seconds": warmup_seconds,
                 "ms_per_step": {v: 1000 * s / args.steps for v, s in best.items()},
                 "tokens_per_second_per_worker": rate,
                 "mfu": metrics.flops_per_token(cfg.model, vocab, cfg.data.seq_len) * rate
                 / metrics.peak_flops(device.type, name)})
    dist.destroy_process_group()


def mfu_text(row: dict) -> str:
    """MFU against the GPU's bf16 peak; a CPU has no meaningful peak here (a nominal 1e11 FLOP/s)."""
    return f"MFU {row['mfu']:.3f}" if row["device"] != "cpu" else "MFU n/a on a CPU"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="overhead.py --step-log", description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-log", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--preset", default="tiny-cpu", choices=sorted(PRESETS),
                        help="model and batch shape (default tiny-cpu)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"],
                        help="inner.precision (default: the preset's, auto: bf16 on a GPU, fp32 on a CPU)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="inner.compile: torch.compile each decoder layer, or not (default: the preset's: on for "
                             "150m and 1b, off for tiny-cpu)")
    parser.add_argument("--world", type=int, default=None,
                        help="ranks (default: the GPU count, or 2 on a machine without one)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per repeat (default 30)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", help="write the results as JSON here too")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    low = [f"--{name}" for name in ("steps", "warmup", "repeats", "world")
           if getattr(args, name) is not None and getattr(args, name) < 1]
    if low:  # before any rank starts: a rank's error would leave this process waiting on its queue
        parser.error(f"{', '.join(low)} must be >= 1")
    world = args.world or (torch.cuda.device_count() or 2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=rank_main, args=(r, world, port, args, results)) for r in range(world)]
    for process in processes:
        process.start()
    rows = sorted((results.get(timeout=3600) for _ in processes), key=lambda r: r["rank"])
    for process in processes:
        process.join()
    for row in rows:
        before, after = row["ms_per_step"]["per-step"], row["ms_per_step"]["step-log"]
        print(f"[step-log] rank {row['rank']} of {row['world']} on {row['device']} ({row['preset']}, "
              f"{row['precision']}{', compiled' if row['compile'] else ''}): per-step read "
              f"{before:.2f} ms/step, StepLog {after:.2f} ms/step, ratio {before / after:.3f}; "
              f"{row['tokens_per_second_per_worker']:,.0f} tokens/s/worker, {mfu_text(row)}; warm-up "
              f"{row['warmup_seconds']:.1f} s", flush=True)
    if args.output:
        with open(args.output, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
