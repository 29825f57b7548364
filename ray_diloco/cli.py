"""`ray-diloco`: list presets, print a resolved config, train."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import yaml

from ray_diloco.methods.settings import AGGREGATIONS, CODEC_NAMES, COMPRESSED, COMPRESSED_LR, METHODS
from ray_diloco.config import ConfigError, ExperimentConfig, RegionConfig, fresh_run_name
from ray_diloco.presets import DEFAULT_PRESET, PRESETS, get_preset


def _add_config_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config, a file or an s3://, gs:// URI (sections model, "
                        "data, inner, outer, regions, run); overrides the preset's values it names")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                        help=f"named starting point (default: {DEFAULT_PRESET})")


class OneLineErrors(argparse.ArgumentParser):
    """A bad flag value is one line naming the flag, exit code 2, like every other user error (argparse
    would print the whole usage block first). `--help` still shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog.split()[0]}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(
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
    train.add_argument("--compression", choices=CODEC_NAMES, help="pseudo-gradient codec on the wire")
    train.add_argument("--outer-method", choices=METHODS,
                       help="what a round sends: diloco (the whole Δ), sparseloco or dct (a few bits per parameter; "
                            "sets outer momentum 0 and the papers' outer lr 1.0 unless --outer-lr is given)")
    train.add_argument("--outer-lr", type=float, metavar="LR",
                       help="the outer learning rate (default: the preset's, 0.7 for diloco; 1.0 with a compressed "
                            "--outer-method)")
    train.add_argument("--topk", type=int, metavar="K",
                       help="values sent per chunk by sparseloco (of 4096; default 128) or dct (of 64; default 2)")
    train.add_argument("--aggregation", choices=AGGREGATIONS,
                       help="how a round combines the regions' Δ: mean (token-weighted) or clipped (each cut to "
                            "outer.clip_factor × the median norm first: a poisoned Δ moves the model a bounded "
                            "amount); every region of a run must use the same")
    train.add_argument("--data", metavar="PATH_OR_GLOB", help="training files in the C4 json.gz layout")
    train.add_argument("--eval-data", metavar="PATH_OR_GLOB", help="held-out files for evaluation")
    train.add_argument("--output-dir", metavar="DIR", help="results go to DIR/<run-name>/ (a directory or an s3://, "
                       "gs:// URI)")
    train.add_argument("--run-name", help="run id: output sub-directory and Hivemind matchmaking scope")
    train.add_argument("--seed", type=int)
    train.add_argument("--initial-peers", help="comma-separated Hivemind multiaddrs of a running region")
    train.add_argument("--listen-host", help="address this driver's region's Hivemind node listens on "
                       "(0.0.0.0 across machines; default outer.host)")
    train.add_argument("--port", type=int, help="TCP port of this driver's region's Hivemind node (fixed where a "
                       "firewall or NAT forward names it; default outer.port, 0: any)")
    train.add_argument("--announce", help="comma-separated multiaddrs the other regions dial to reach this driver's "
                       "region, e.g. /ip4/203.0.113.7/tcp/31337 (behind NAT: the public address and forwarded port)")
    train.add_argument("--secret-file", metavar="FILE", help="the run's secret (at least 32 bytes), the same file in every "
                       "region (create it with `openssl rand -hex 32 > FILE`): only holders of it take part")
    train.add_argument("--local-regions", help="comma-separated regions of the config this Ray cluster runs "
                                               "(one cluster per region); default: all")
    train.add_argument("--mode", choices=["diloco", "ddp", "single"],
                       help="diloco (default); ddp: one group over all workers, gradient all-reduce every step; "
                            "single: one worker. Same model, data, inner optimizer and steps")
    train.add_argument("--init-from", metavar="DIR", help="warm start from a saved model (a run's model/ dir; "
                       "a directory or an s3://, gs:// URI)")
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
    train.add_argument("--address", help="run on this Ray cluster ('auto': the one `ray start` runs on this machine); "
                       "default: start a private local Ray (inside `ray job submit`: the job's cluster)")
    train.add_argument("--debug", action="store_true", help="show the traceback of configuration errors too")
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


def read_config_file(path: str) -> dict:
    """The YAML mapping in `--config` (a local file or a URI); a syntax error is reported as file:line:column,
    not a traceback."""
    from ray_diloco import uris

    try:
        text = uris.read_bytes(path).decode()
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {path}") from None
    except (OSError, ValueError) as error:  # an unreachable store, no access, a malformed URI
        raise ConfigError(f"--config: cannot read {path} ({uris.first_line(error)})") from None
    try:
        given = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"--config: {where}: invalid YAML ({problem})") from None
    if not isinstance(given, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of sections (model, data, ...)")
    return given


def resolve_config(args: argparse.Namespace) -> ExperimentConfig:
    """Preset, then the YAML file, then the flags: each later source overrides what it names."""
    preset = args.preset or DEFAULT_PRESET
    merged = get_preset(preset).to_dict()
    if args.config:
        for section, values in read_config_file(args.config).items():
            mergeable = isinstance(values, dict) and isinstance(merged.get(section), dict)
            merged[section] = {**merged[section], **values} if mergeable else values
    cfg = ExperimentConfig.from_dict(merged)
    if getattr(args, "command", None) != "train":
        return cfg
    cfg = apply_flags(cfg, args)
    if cfg.run.name is None:
        if cfg.run.resume:
            raise ConfigError("--resume: name the run to continue with --run-name (runs without a name get a "
                              "fresh one)")
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=fresh_run_name(preset)))
    return cfg


def _regions_from_flag(value: str, template: RegionConfig, workers: int) -> list[RegionConfig]:
    """Regions named by `--regions` (a count or names), each shaped like the preset's or config's first
    region: its per-worker CPUs and GPUs stay (a GPU preset must not silently become a CPU run)."""
    if value.strip().isdigit():
        count = int(value)
        if count < 1:
            raise ConfigError("--regions: give at least 1")
        names = [f"region-{chr(ord('a') + i)}" if i < 26 else f"region-{i}" for i in range(count)]
    else:
        names = [name.strip() for name in value.split(",") if name.strip()]
        if not names:
            raise ConfigError("--regions: give a count (3) or comma-separated names (us,eu)")
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:  # the config's own check would name its field (`regions:`), not the flag the user typed
            raise ConfigError(f"--regions: each region once, got {', '.join(repeated)} more than once")
    try:
        return [dataclasses.replace(template, name=name, workers=workers) for name in names]
    except ConfigError as error:
        raise ConfigError(f"--regions: {error}") from None


def _check_flag(args: argparse.Namespace, flag: str, minimum: int) -> None:
    value = getattr(args, flag)
    if value is not None and value < minimum:
        raise ConfigError(f"--{flag.replace('_', '-')}: must be >= {minimum}, got {value}")


def _outer_method_flags(outer, args: argparse.Namespace):
    """--outer-method with what the method needs (a compressed one: plain SGD at its papers' lr), --outer-lr,
    --topk."""
    replace = dataclasses.replace
    if args.outer_lr is not None and not args.outer_lr > 0:
        raise ConfigError(f"--outer-lr: must be > 0, got {args.outer_lr}")
    _check_flag(args, "topk", 1)
    if args.outer_method in COMPRESSED:
        outer = replace(outer, method=args.outer_method, momentum=0.0, nesterov=False, lr=COMPRESSED_LR)
    elif args.outer_method is not None:
        outer = replace(outer, method=args.outer_method)
    if args.outer_lr is not None:
        outer = replace(outer, lr=args.outer_lr)
    if args.aggregation is not None:
        outer = replace(outer, aggregation=args.aggregation)
    if args.topk is not None:
        try:
            outer = replace(outer, topk=args.topk)
        except ConfigError as error:  # name the flag the user typed, not the field it sets
            raise ConfigError(f"--topk: {str(error).removeprefix('outer.topk: ')}") from None
    return outer


def apply_flags(cfg: ExperimentConfig, args: argparse.Namespace) -> ExperimentConfig:
    replace = dataclasses.replace
    # Checked here, so an error names the flag the user typed (0 is a value, not "not given").
    for flag, minimum in (("workers_per_region", 1), ("inner_steps", 1), ("outer_steps", 1), ("eval_every", 0),
                          ("checkpoint_every", 0), ("max_failures", 0)):
        _check_flag(args, flag, minimum)
    regions = cfg.regions
    if args.regions is not None:
        workers = args.workers_per_region if args.workers_per_region is not None else regions[0].workers
        regions = _regions_from_flag(args.regions, regions[0], workers)
    elif args.workers_per_region is not None:
        regions = [replace(r, workers=args.workers_per_region) for r in regions]
    outer = cfg.outer
    if args.inner_steps is not None:
        outer = replace(outer, inner_steps=args.inner_steps)
    if args.compression is not None:
        outer = replace(outer, compression=args.compression)
    outer = _outer_method_flags(outer, args)
    if args.initial_peers is not None:
        outer = replace(outer, initial_peers=[p.strip() for p in args.initial_peers.split(",") if p.strip()])
    if args.secret_file is not None:
        outer = replace(outer, secret_file=args.secret_file)
    data = cfg.data
    if args.data is not None:
        data = replace(data, path=args.data)
    if args.eval_data is not None:
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
    if args.local_regions is not None:
        local = [n.strip() for n in args.local_regions.split(",") if n.strip()]
        names = [r.name for r in regions]
        unknown = [n for n in local if n not in names]
        if not local or unknown:
            raise ConfigError(f"--local-regions: {unknown or 'nothing'} given; name regions of the config: {names}")
        run = replace(run, local_regions=local)
    regions = _apply_network_flags(regions, run.local_regions, args)
    return replace(cfg, regions=regions, outer=outer, data=data, run=run)


def _apply_network_flags(regions: list[RegionConfig], local: list[str], args: argparse.Namespace
                         ) -> list[RegionConfig]:
    """--listen-host, --port, --announce: the Hivemind address of the region this driver runs (each cluster of a
    run has its own, while the config file is the same everywhere)."""
    given: dict = {}
    if args.listen_host is not None:
        given["host"] = args.listen_host
    if args.port is not None:
        if not 0 <= args.port <= 65535:
            raise ConfigError(f"--port: must be a TCP port (0: any free one), got {args.port}")
        given["port"] = args.port
    if args.announce is not None:
        given["announce"] = [a.strip() for a in args.announce.split(",") if a.strip()]
    mine = [r.name for r in regions if not local or r.name in local]
    named = [f"--{flag}" for flag, key in (("port", "port"), ("announce", "announce")) if key in given]
    if named and len(mine) > 1:
        raise ConfigError(f"{named[0]}: names one region's address, but this driver runs regions {mine}; give "
                          "--local-regions <one region>")
    return [dataclasses.replace(r, **given) if r.name in mine else r for r in regions]


def train(cfg: ExperimentConfig, address: str | None) -> int:
    """`ray-diloco train`: SIGTERM and SIGINT are handled from here on (`RunStop`), the checks included."""
    from ray_diloco.stopping import RunStop, RunStopped

    try:
        with RunStop(cfg.run.stop_timeout_seconds) as stop:
            from ray_diloco.resources import check_local_machine, local_cores
            from ray_diloco.run_setup import cluster_address, prepare_run, training_groups

            # Every input is checked before Ray, torch and the driver are even imported: a bad flag costs seconds.
            groups = training_groups(cfg)
            if cluster_address(address) is None:  # the driver would start a private Ray here: too big fails now,
                check_local_machine(groups, local_cores())  # before the run's setup (tokenizer, data files)
            prepared = prepare_run(cfg, groups)
            from ray_diloco.driver import run_training

            summary = run_training(cfg, address=address, prepared=prepared, stop=stop)
    except RunStopped as stopped:  # asked for: one line, no traceback
        print(f"[driver] {stopped}", flush=True)
        return 0
    if summary.get("unsettled"):  # the regions of the run did not end on one θ_global: never a quiet success
        why = (f"region(s) {', '.join(summary['disagreeing_regions'])} hold another θ_global than the exported "
               f"{summary['exported_digest']}" if summary["disagreeing_regions"] else
               "its end could not be checked against the other regions' (events unsettled_at_end)")
        print(f"ray-diloco: error: run {cfg.run.name} ended unsettled: {why}; see summary.json", file=sys.stderr)
        return 1
    return 0 if summary["eval_loss"] == summary["eval_loss"] else 1  # NaN loss fails the command


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
        return train(cfg, args.address)
    except ConfigError as error:
        if getattr(args, "debug", False):
            raise
        print(f"ray-diloco: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
