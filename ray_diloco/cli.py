"""`ray-diloco`: list presets, print a resolved config, train."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import yaml

from ray_diloco.config import ConfigError, ExperimentConfig, RegionConfig
from ray_diloco.presets import DEFAULT_PRESET, PRESETS, get_preset


def _add_config_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config (sections model, data, inner, outer, "
                        "regions, run); overrides the preset's values it names")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                        help=f"named starting point (default: {DEFAULT_PRESET})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ray-diloco",
        description="DiLoCo training of LLMs across regions: Ray Train FSDP2 groups per region, "
                    "Hivemind between regions.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("presets", help="list the named presets")
    show = commands.add_parser("config", help="print the resolved configuration as YAML")
    _add_config_source(show)

    train = commands.add_parser("train", help="train (no arguments: the tiny-cpu default on the bundled C4 sample)")
    _add_config_source(train)
    train.add_argument("--regions", help="a count (3) or comma-separated names (us,eu)")
    train.add_argument("--workers-per-region", type=int, metavar="N")
    train.add_argument("--inner-steps", type=int, metavar="H", help="inner steps between outer steps")
    train.add_argument("--outer-steps", type=int, metavar="T")
    train.add_argument("--compression", choices=["none", "bf16", "fp16"], help="pseudo-gradient codec on the wire")
    train.add_argument("--data", metavar="PATH_OR_GLOB", help="training files in the C4 json.gz layout")
    train.add_argument("--eval-data", metavar="PATH_OR_GLOB", help="held-out files for evaluation")
    train.add_argument("--output-dir", metavar="DIR")
    train.add_argument("--run-name", help="run id: output sub-directory and Hivemind matchmaking scope")
    train.add_argument("--seed", type=int)
    train.add_argument("--initial-peers", help="comma-separated Hivemind multiaddrs of a running region")
    train.add_argument("--mode", choices=["diloco", "ddp", "single"],
                       help="diloco (default); ddp: one group over all workers, gradient all-reduce every step; "
                            "single: one worker. Same model, data, inner optimizer and steps")
    train.add_argument("--init-from", metavar="DIR", help="warm start from a saved model (a run's model/ dir)")
    train.add_argument("--eval-every", type=int, metavar="K", help="held-out loss every K outer steps")
    train.add_argument("--checkpoint-every", type=int, metavar="K",
                       help="checkpoint every K outer steps: workers (model and AdamW shards, schedule and data "
                            "position, via Ray Train) and the outer state (θ_global, momentum, outer step)")
    train.add_argument("--checkpoint-path", metavar="DIR_OR_URI",
                       help="where checkpoints go: a directory or s3://, gs:// URI every node reaches "
                            "(default: <output-dir>/<run-name>/checkpoints)")
    train.add_argument("--max-failures", type=int, metavar="N",
                       help="restarts of a region's worker group after a worker dies (default 1)")
    train.add_argument("--resume", action="store_true",
                       help="continue the run of the same --run-name from its latest committed checkpoints, and fail "
                            "if there are none (a run started again under its name continues from them anyway)")
    train.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    export = commands.add_parser("export", help="write θ_global of an outer checkpoint as a Hugging Face model dir")
    export.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="<checkpoints>/<region>/outer-NNNNNN, or <checkpoints>/<region> for the latest "
                             "(a directory or an s3://, gs:// URI)")
    export.add_argument("--out", required=True, metavar="DIR")
    return parser


def export_checkpoint(checkpoint: str, out: str) -> Path:
    """θ_global of an outer checkpoint + its run's config + tokenizer → `save_pretrained` directory."""
    from ray_diloco.checkpoint import CheckpointStore, load_outer_checkpoint
    from ray_diloco.model import build_model, save_model
    from ray_diloco.tokenizer import load_tokenizer

    store = CheckpointStore(checkpoint)
    latest = store.latest_step()  # given a region's directory: its latest checkpoint
    try:
        saved = load_outer_checkpoint(store.location(latest) if latest is not None else checkpoint)
    except FileNotFoundError as error:
        raise ConfigError(f"--checkpoint: {error}") from error
    cfg = ExperimentConfig.from_dict(yaml.safe_load(saved.config_yaml))
    model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, cfg.run.seed)
    save_model(model, saved.theta, Path(out), load_tokenizer(cfg.data.tokenizer))
    print(f"exported outer step {saved.outer_step} of run {cfg.run.name} to {out}")
    return Path(out)


def resolve_config(args: argparse.Namespace) -> ExperimentConfig:
    """Preset, then the YAML file, then the flags: each later source overrides what it names."""
    merged = get_preset(args.preset or DEFAULT_PRESET).to_dict()
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"--config: no such file {path}")
        given = yaml.safe_load(path.read_text()) or {}
        if not isinstance(given, dict):
            raise ConfigError(f"--config: {path} must hold a mapping of sections (model, data, ...)")
        for section, values in given.items():
            mergeable = isinstance(values, dict) and isinstance(merged.get(section), dict)
            merged[section] = {**merged[section], **values} if mergeable else values
    cfg = ExperimentConfig.from_dict(merged)
    return apply_flags(cfg, args) if getattr(args, "command", None) == "train" else cfg


def _regions_from_flag(value: str, workers: int) -> list[RegionConfig]:
    if value.isdigit():
        if int(value) < 1:
            raise ConfigError("--regions: give at least 1")
        return [RegionConfig(name=f"region-{chr(ord('a') + i)}" if i < 26 else f"region-{i}", workers=workers)
                for i in range(int(value))]
    return [RegionConfig(name=name.strip(), workers=workers) for name in value.split(",") if name.strip()]


def apply_flags(cfg: ExperimentConfig, args: argparse.Namespace) -> ExperimentConfig:
    replace = dataclasses.replace
    regions = cfg.regions
    if args.regions:
        workers = args.workers_per_region or regions[0].workers
        regions = _regions_from_flag(args.regions, workers)
    elif args.workers_per_region:
        regions = [replace(r, workers=args.workers_per_region) for r in regions]
    outer = cfg.outer
    if args.inner_steps is not None:
        outer = replace(outer, inner_steps=args.inner_steps)
    if args.compression:
        outer = replace(outer, compression=args.compression)
    if args.initial_peers:
        outer = replace(outer, initial_peers=[p.strip() for p in args.initial_peers.split(",") if p.strip()])
    data = cfg.data
    if args.data:
        data = replace(data, path=args.data)
    if args.eval_data:
        data = replace(data, eval_path=args.eval_data)
    run = cfg.run
    for flag, field in (("outer_steps", "outer_steps"), ("seed", "seed"), ("output_dir", "output_dir"),
                        ("run_name", "name"), ("mode", "mode"), ("init_from", "init_from"),
                        ("eval_every", "eval_every"), ("checkpoint_every", "checkpoint_every"),
                        ("checkpoint_path", "checkpoint_path"), ("max_failures", "max_failures")):
        if getattr(args, flag) is not None:
            run = replace(run, **{field: getattr(args, flag)})
    if args.resume:
        run = replace(run, resume=True)
    return replace(cfg, regions=regions, outer=outer, data=data, run=run)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "presets":
            for name, factory in PRESETS.items():
                cfg = factory()
                print(f"{name:10s} hidden {cfg.model.hidden_size:5d} layers {cfg.model.num_layers:3d} "
                      f"seq {cfg.data.seq_len:5d} H {cfg.outer.inner_steps:4d} "
                      f"regions {len(cfg.regions)}x{cfg.regions[0].workers}"
                      + ("  (default)" if name == DEFAULT_PRESET else ""))
            return 0
        if args.command == "export":
            export_checkpoint(args.checkpoint, args.out)
            return 0
        cfg = resolve_config(args)
        if args.command == "config":
            print(cfg.to_yaml(), end="")
            return 0
        from ray_diloco.driver import run_training  # Ray and torch load only for training

        summary = run_training(cfg, address=args.address)
        return 0 if summary["eval_loss"] == summary["eval_loss"] else 1  # NaN loss fails the command
    except ConfigError as error:
        print(f"ray-diloco: configuration error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
