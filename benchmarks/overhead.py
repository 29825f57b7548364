"""What Ray + FSDP2 + the SyncActor cost: tokens/s per worker of a real run ÷ a bare PyTorch loop.

    python benchmarks/overhead.py                       # ~8 min on 2 CPU cores
    python benchmarks/overhead.py --regions 1,2 --inner-steps 20 --outer-steps 3
    python benchmarks/overhead.py --step-log [--preset 150m]   # the per-step cost of reading the loss
                                                               # (benchmarks/step_log_cost.py)

For each entry R of `--regions` (default 1 and 2), in one invocation on the same machine:

* the framework: `run_training` in mode diloco with R regions × 1 worker (Ray Train, FSDP2 over gloo,
  Ray Data streaming the bundled C4 sample, a SyncActor per region, Hivemind between regions when R > 1,
  an outer step every H inner steps). Its `tokens_per_second_per_worker` is tokens over the time in the
  training loop: start-up (Ray, actors, model build, FSDP wrap) is excluded; the first batch's wait on
  Ray Data, every step's data fetch and every outer step (sync) are included;
* the bare loop: R concurrent processes (same concurrency on the same cores), each running
  `ray_diloco.model.build_model` with the same config and seed, the same batch and sequence length, one
  torch thread, the same AdamW (`build_inner_optimizer`), gradient clipping and the same number of steps,
  on token windows already in memory. Timed over all steps, from a barrier all processes pass together.

The ratio framework ÷ bare is the share of bare-PyTorch speed the framework keeps (1.0 = no overhead).
A second ratio compares the median inner step of each (the framework's from its workers, measured the same
way): the steady state once Ray Data streams, without the one-off wait for the first batch, which on a
short run on few cores is most of the difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ray_diloco.cli import OneLineErrors
from ray_diloco.config import DataConfig, ExperimentConfig, RegionConfig
from ray_diloco.presets import tiny_cpu

DEFAULT_OUTPUT_DIR = "runs/overhead"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="overhead.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--regions", default="1,2",
                        help="comma-separated region counts (1 worker each) to measure (default 1,2)")
    parser.add_argument("--inner-steps", type=int, default=20, metavar="H", help="default 20")
    parser.add_argument("--outer-steps", type=int, default=3, metavar="T",
                        help="the run and the bare loop both take T×H steps (default 3)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: tiny-cpu's 128")
    parser.add_argument("--batch-size", type=int, default=None, help="default: tiny-cpu's 8")
    parser.add_argument("--compression", default="fp16", choices=["none", "fp16", "bf16"])
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    parser.add_argument("--step-log", action="store_true",
                        help="instead: the per-step cost of reading the loss on the worker's own inner step, no Ray "
                             "(benchmarks/step_log_cost.py; its flags: overhead.py --step-log --help)")
    return parser


def run_config(args: argparse.Namespace, regions: int) -> ExperimentConfig:
    cfg = tiny_cpu()
    data = dataclasses.replace(cfg.data, seq_len=args.seq_len or cfg.data.seq_len,
                               batch_size=args.batch_size or cfg.data.batch_size)
    outer = dataclasses.replace(cfg.outer, inner_steps=args.inner_steps, compression=args.compression,
                                matchmaking_seconds=120.0, averaging_timeout=300.0)
    run = dataclasses.replace(cfg.run, name=f"overhead-{regions}x1", mode="diloco", outer_steps=args.outer_steps,
                              output_dir=str(Path(args.output_dir).resolve()), eval_every=0, max_failures=0)
    return dataclasses.replace(cfg, data=data, outer=outer, run=run,
                               regions=[RegionConfig(name=f"region-{i}", workers=1) for i in range(regions)])


def _bare_windows(data: DataConfig, tokenizer) -> Any:
    """Token windows of the first bundled training shard, in memory (the eval-set reader cuts them)."""
    from ray_diloco.data import embedded_train_dir, load_eval_windows

    shard = str(Path(embedded_train_dir()) / "c4-train.00000-of-00008.json.gz")
    return load_eval_windows(dataclasses.replace(data, eval_path=shard, eval_windows=10_000), tokenizer)


def bare_worker(config: dict, steps: int, barrier: Any, results: Any, index: int) -> None:
    """One bare process: the same model, optimizer and batch as a framework worker, no Ray, no FSDP."""
    import torch

    from ray_diloco.inner import build_inner_optimizer
    from ray_diloco.model import build_model
    from ray_diloco.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    cfg = ExperimentConfig.from_dict(config)
    windows = _bare_windows(cfg.data, load_tokenizer(cfg.data.tokenizer))
    model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, cfg.run.seed)
    model.train()
    optimizer, scheduler = build_inner_optimizer(model.parameters(), cfg.inner, steps, torch.device("cpu"))
    batch, n = cfg.data.batch_size, len(windows) // cfg.data.batch_size
    barrier.wait()
    started, tokens, step_rates = time.perf_counter(), 0, []
    for step in range(steps):
        step_started = time.perf_counter()
        input_ids = windows[(step % n) * batch:(step % n + 1) * batch]
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        if cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # the framework reads the loss every step for its status line
        tokens += input_ids.numel()
        step_rates.append(input_ids.numel() / (time.perf_counter() - step_started))
    results.put((index, tokens / (time.perf_counter() - started), statistics.median(step_rates), float(loss)))


def bare_tokens_per_second(cfg: ExperimentConfig, processes: int) -> dict[str, Any]:
    """Mean tokens/s per process of `processes` bare loops running at the same time."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=bare_worker, args=(cfg.to_dict(), cfg.total_inner_steps, barrier, results, i))
             for i in range(processes)]
    for proc in procs:
        proc.start()
    measured = [results.get(timeout=1800) for _ in procs]
    for proc in procs:
        proc.join()
    rates = [rate for _, rate, _, _ in measured]
    medians = [median for _, _, median, _ in measured]
    return {"processes": processes, "tokens_per_second_per_process": sum(rates) / len(rates),
            "median_step_tokens_per_second": sum(medians) / len(medians),
            "rates": rates, "final_losses": [loss for _, _, _, loss in measured]}


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| setup | concurrent workers | framework tokens/s/worker | bare PyTorch tokens/s/process "
             "| ratio framework ÷ bare | median step: framework | median step: bare | median step ratio "
             "| framework compute utilization | framework wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['workers']} | {r['framework_tokens_per_second_per_worker']:,.0f} "
                     f"| {r['bare_tokens_per_second_per_process']:,.0f} | {r['ratio']:.3f} "
                     f"| {r['framework_median_step_tokens_per_second']:,.0f} "
                     f"| {r['bare_median_step_tokens_per_second']:,.0f} | {r['median_step_ratio']:.3f} "
                     f"| {r['compute_utilization']:.3f} | {r['wall_seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--step-log" in argv:  # a measurement of its own (no Ray): what reading the loss costs per step
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from step_log_cost import main as step_log_main

        return step_log_main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        counts = [int(x) for x in args.regions.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        parser.error(f"--regions takes comma-separated region counts >= 1, got {args.regions!r}")
    low = [f"--{name.replace('_', '-')}" for name in ("inner_steps", "outer_steps") if getattr(args, name) < 1]
    if low:
        parser.error(f"{' and '.join(low)} must be >= 1")
    import ray

    from ray_diloco.driver import run_training
    from ray_diloco.run_setup import resolve_vocab

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare import ray_session  # one fresh local Ray per run, as compare.py does
    from ray_diloco.tokenizer import load_tokenizer

    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(None)
    rows = []
    for regions in counts:
        cfg = resolve_vocab(run_config(args, regions), tokenizer)
        # The bare loop first, while no Ray is up: its idle daemons would otherwise share the cores.
        print(f"[overhead] bare PyTorch: {regions} concurrent process(es), {cfg.total_inner_steps} steps",
              flush=True)
        bare = bare_tokens_per_second(cfg, regions)
        print(f"[overhead] framework: {regions} region(s) × 1 worker, diloco", flush=True)
        with ray_session(args.address, regions):
            summary = run_training(cfg, address=args.address)
        framework = summary["tokens_per_second_per_worker"]
        rows.append({
            "setup": f"diloco {regions} region(s) × 1 worker" + (" (Hivemind)" if regions > 1 else
                                                                 " (SyncActor, no wire)"),
            "workers": regions, "steps": cfg.total_inner_steps, "inner_steps": args.inner_steps,
            "framework_tokens_per_second_per_worker": framework,
            "bare_tokens_per_second_per_process": bare["tokens_per_second_per_process"],
            "bare_rates": bare["rates"],
            "ratio": framework / bare["tokens_per_second_per_process"],
            "framework_median_step_tokens_per_second": summary["median_step_tokens_per_second_per_worker"],
            "bare_median_step_tokens_per_second": bare["median_step_tokens_per_second"],
            "median_step_ratio": summary["median_step_tokens_per_second_per_worker"]
            / bare["median_step_tokens_per_second"],
            "compute_utilization": summary["compute_utilization"],
            "sync_seconds": summary["sync_seconds"],
            "wall_seconds": summary["wall_seconds"],
        })
    table = markdown_table(rows)
    import torch

    result = {"settings": {k: v for k, v in vars(args).items()}, "rows": rows,
              "machine": {"nproc": os.cpu_count(), "torch": torch.__version__, "ray": ray.__version__}}
    (out / "overhead.json").write_text(json.dumps(result, indent=2))
    (out / "overhead.md").write_text(table + "\n")
    print(table)
    print(f"[overhead] wrote {out / 'overhead.json'} and {out / 'overhead.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
