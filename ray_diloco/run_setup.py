"""What the driver settles before Ray starts: where the run's files go, that its inputs are usable, whether
it continues an earlier run and from which outer step. Nothing is written here, and every problem is a
one-line `ConfigError` naming the flag or file, so a bad input costs seconds, not a cluster start-up.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ray_diloco import uris
from ray_diloco.config import ConfigError, ExperimentConfig, RegionConfig, local_path
from ray_diloco.continuation import config_changes
from ray_diloco.network import check_driver_ports
from ray_diloco.run_storage import check_run_storage
from ray_diloco.results import ResultsDir
from ray_diloco.sync import policy

logger = logging.getLogger(__name__)

# Ray sets this in the environment of a `ray job submit` driver, whose working directory is Ray's temporary,
# per-upload copy of the working dir: relative output paths there would vanish with the session.
RAY_JOB_ENV_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"


# How long `ray job stop` lets the driver run after its SIGTERM before it kills it (Ray's job supervisor reads it
# from the job's runtime_env, which the driver sees too).
JOB_STOP_WAIT_ENV_VAR = "RAY_JOB_STOP_WAIT_TIME_S"


# Ray's job supervisor waits this long after `ray job stop`'s SIGTERM when the runtime_env does not say.
RAY_DEFAULT_JOB_STOP_WAIT_S = 3


def check_job_stop_wait(cfg: ExperimentConfig, value: str | None, in_job: bool) -> None:
    """Ray must let a stopped job wait for its stop: run.stop_timeout_seconds, then the export and summary. A
    shorter RAY_JOB_STOP_WAIT_TIME_S gets the driver SIGKILLed mid-stop, losing the round's checkpoint. Outside a
    Ray job (ray-diloco train) nothing kills the driver, so there is nothing to check."""
    from ray_diloco.stopping import FINISHING_MARGIN_SECONDS

    if value is None:
        if not in_job:
            return
        value = f"{RAY_DEFAULT_JOB_STOP_WAIT_S} (Ray's default: not set)"
        wait = RAY_DEFAULT_JOB_STOP_WAIT_S
    else:
        try:
            wait = int(value)  # what Ray parses it with
        except ValueError:
            raise ConfigError(f"{JOB_STOP_WAIT_ENV_VAR}: {value!r} is not a whole number of seconds (Ray reads it "
                              "with int())") from None
    need = cfg.run.stop_timeout_seconds + FINISHING_MARGIN_SECONDS
    if wait < need:
        raise ConfigError(f"{JOB_STOP_WAIT_ENV_VAR}={value} is shorter than run.stop_timeout_seconds "
                          f"({cfg.run.stop_timeout_seconds:g}) + {FINISHING_MARGIN_SECONDS:g} s for the export: "
                          f"Ray would kill a stopping job; set it to at least {need:.0f} in the runtime_env "
                          "(jobs/runtime_env.yaml) or lower run.stop_timeout_seconds")


def training_groups(cfg: ExperimentConfig) -> list[RegionConfig]:
    """The Ray Train groups of a mode: one per region (diloco), one over all workers (ddp), one worker."""
    if cfg.run.mode == "diloco":
        return cfg.local_regions()
    template = cfg.regions[0]
    if cfg.run.mode == "ddp":
        return [dataclasses.replace(template, name="ddp", workers=sum(r.max_workers for r in cfg.regions))]
    return [dataclasses.replace(template, name="single", workers=1)]


def in_ray_job() -> bool:
    return RAY_JOB_ENV_VAR in os.environ


def cluster_address(address: str | None) -> str | None:
    """The Ray cluster a driver attaches to: --address, else RAY_ADDRESS (`ray job submit` sets it); None: the
    driver starts a private local Ray on this machine."""
    return address or os.environ.get("RAY_ADDRESS") or None


def resolve_paths(cfg: ExperimentConfig) -> ExperimentConfig:
    """Absolute output and checkpoint paths (actors' working directories differ from ours): relative ones
    resolve against the directory `ray-diloco` started in, or the home directory inside a Ray job."""
    base = os.path.expanduser("~") if in_ray_job() else os.getcwd()

    def absolute(path: str) -> str:
        return path if "://" in path else local_path(path, base)

    run = dataclasses.replace(cfg.run, output_dir=absolute(cfg.run.output_dir))
    if run.checkpoint_path:
        run = dataclasses.replace(run, checkpoint_path=absolute(run.checkpoint_path))
    if run.init_from:
        run = dataclasses.replace(run, init_from=absolute(run.init_from))
    return dataclasses.replace(cfg, run=run)


def run_file_suffix(cfg: ExperimentConfig) -> str:
    """'' for the driver of a whole run; '-<regions>' for one that runs part of it (--local-regions) or joins a
    run started elsewhere (initial peers), so the drivers of one run write their config and summary side by side."""
    local = cfg.local_regions()
    partial = cfg.outer.initial_peers or len(local) < len(cfg.regions)
    return "-" + "-".join(r.name for r in local) if partial else ""


def check_writable(directory: Path, flag: str) -> None:
    """A file can be created in the nearest existing ancestor of `directory` (tried, and removed at once:
    `os.access` says yes to root everywhere, /proc included)."""
    existing = directory
    while not existing.exists():
        existing = existing.parent
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ConfigError(f"{flag}: cannot write under {existing} ({error.strerror}); give a directory you can "
                          "write to") from None


def check_storage(location: str, flag: str) -> None:
    """The run can write under `location`, a local directory (`check_writable`) or a URI: its bucket exists, is
    reachable and takes writes (for an S3-compatible server: AWS_ENDPOINT_URL names it)."""
    if not uris.is_uri(location):
        check_writable(Path(location), flag)
        return
    try:
        uris.probe_write(location)
    except OSError as error:
        raise ConfigError(f"{flag}: cannot write to {location} ({uris.first_line(error)}); give a bucket that exists "
                          "and that these credentials may write to (an S3-compatible server: set AWS_ENDPOINT_URL)"
                          ) from None


def check_continuation(stored_yaml: str, cfg: ExperimentConfig, where: str) -> None:
    """A run continued under its name must keep what its checkpoints and data positions depend on."""
    try:
        stored = ExperimentConfig.from_dict(yaml.safe_load(stored_yaml))
    except (ConfigError, yaml.YAMLError) as error:
        raise ConfigError(f"--run-name: {where} holds a config this version cannot read ({error}); "
                          "choose another --run-name") from None
    if stored.run.name not in (None, cfg.run.name):  # a run's directory copied or renamed by hand
        raise ConfigError(f"--run-name {cfg.run.name}: {where} belongs to run {stored.run.name!r}; choose another "
                          "--run-name or --checkpoint-path")
    breaking, allowed = config_changes(stored, cfg)
    if breaking:
        raise ConfigError(f"--run-name {cfg.run.name}: {where} belongs to a run with another "
                          f"{'; '.join(breaking)}: keep these to continue it, or choose another --run-name")
    if allowed:
        logger.warning("continuing run %s with changed settings: %s", cfg.run.name, "; ".join(allowed))


def no_checkpoint_error(cfg: ExperimentConfig) -> ConfigError:
    return ConfigError(f"--resume: no committed checkpoint of run {cfg.run.name} under {cfg.run.checkpoint_root()}; "
                       "was it started with --checkpoint-every, and with this --run-name and --checkpoint-path?")


def require_checkpoints(cfg: ExperimentConfig) -> None:
    """--resume with nothing to resume from is said at once, before the slower checks (tokenizer, model)."""
    from ray_diloco.checkpoint import CheckpointStore, join

    root = cfg.run.checkpoint_root()
    try:
        found = any(CheckpointStore(join(root, r.name)).steps() for r in cfg.local_regions())
    except OSError as error:  # an unreachable store or no access: it runs before check_storage says so
        flag = "--checkpoint-path" if cfg.run.checkpoint_path else "--output-dir"
        raise ConfigError(f"{flag}: cannot list the checkpoints under {root} ({uris.first_line(error)})") from None
    if not found:
        raise no_checkpoint_error(cfg)


def resume_plan(cfg: ExperimentConfig) -> dict[str, int | None]:
    """Per region: the outer step it resumes from, or None for a fresh start. `--resume` insists on one."""
    from ray_diloco.checkpoint import CONFIG_FILE, CheckpointStore, join

    root = cfg.run.checkpoint_root()
    stores = {r.name: CheckpointStore(join(root, r.name)) for r in cfg.local_regions()}  # this cluster's
    plan = policy.choose_resume_steps({name: store.steps() for name, store in stores.items()}, cfg.run.checkpoint_every)
    if all(step is None for step in plan.values()):
        if cfg.run.resume:
            raise no_checkpoint_error(cfg)
        return plan
    region, step = next((r, s) for r, s in plan.items() if s is not None)
    store = stores[region]
    with store.fs.open_input_file(join(store.path, f"outer-{step:06d}", CONFIG_FILE)) as handle:
        check_continuation(handle.read().decode(), cfg, join(store.location(step), CONFIG_FILE))
    behind = [r for r, s in plan.items() if s is None or s < max(x for x in plan.values() if x is not None)]
    if behind:
        logger.warning("regions %s resume from older (or no) checkpoints and catch up from their peers", behind)
    return plan


def require_saved_model(directory: str) -> None:
    """--init-from names a saved model directory: it holds config.json (a local path or a URI)."""
    try:
        found = uris.is_file(uris.join(directory, "config.json"))
    except OSError as error:  # an unreachable store, no access
        raise ConfigError(f"--init-from: cannot read {directory} ({uris.first_line(error)})") from None
    if not found:
        raise ConfigError(f"--init-from: {directory} holds no config.json; give a run's model/ directory "
                          "or the output of `ray-diloco export`")


def check_init_from(cfg: ExperimentConfig) -> None:
    from ray_diloco.model import check_saved_shape, llama_config

    try:
        check_saved_shape(cfg.run.init_from, llama_config(cfg.model, cfg.model.vocab_size, cfg.data.seq_len))
    except (OSError, ValueError) as error:
        raise ConfigError(str(error).splitlines()[0].replace("--init-from ", "--init-from: ", 1)) from None


def resolve_vocab(cfg: ExperimentConfig, tokenizer) -> ExperimentConfig:
    """Fix the model's vocabulary from the tokenizer once, so workers never load the tokenizer to size it."""
    from ray_diloco.model import padded_vocab_size

    try:
        vocab = padded_vocab_size(cfg.model, len(tokenizer))
    except ValueError as error:
        raise ConfigError(f"model.vocab_size: {error}") from None
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


# The held-out evaluation during a run costs at most this share of its training compute (run.eval_every: None).
EVAL_COMPUTE_SHARE = 0.05


def resolve_eval_every(cfg: ExperimentConfig, groups: list[RegionConfig]) -> ExperimentConfig:
    """run.eval_every None -> an interval K: one evaluation is a forward pass (≈ 2N FLOPs a token) over
    data.eval_windows windows; K outer steps of training are 6N FLOPs a token over H × batch × grad_accum windows
    per worker, for this cluster's workers (the evaluator shares their nodes). K is the smallest interval with
    evaluation ≤ EVAL_COMPUTE_SHARE of training; 0 (the end's only) when K exceeds the run."""
    if cfg.run.eval_every is not None:
        return cfg
    workers = sum(g.min_workers for g in groups)
    windows_trained = cfg.outer.inner_steps * cfg.data.batch_size * cfg.inner.grad_accum * workers
    every = math.ceil(cfg.data.eval_windows / (3 * EVAL_COMPUTE_SHARE * windows_trained))
    every = every if every <= cfg.run.outer_steps else 0
    said = f"every {every} outer step(s)" if every else "at the end only (one mid-run evaluation would cost more)"
    print(f"[driver] held-out evaluation {said}: run.eval_every chosen for <= {EVAL_COMPUTE_SHARE:.0%} of the "
          "training compute (set it to override; 0: start and end only)", flush=True)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, eval_every=every))


@dataclass
class PreparedRun:
    cfg: ExperimentConfig
    tokenizer: Any
    results: ResultsDir
    suffix: str  # run_file_suffix
    resume: dict[str, int | None]


def check_secret(cfg: ExperimentConfig) -> None:
    """A given secret file must be readable and long enough, before Ray starts (the driver reads it again when it
    starts its SyncActors)."""
    if cfg.outer.secret_file:
        from ray_diloco.sync.secret import read_secret

        try:
            read_secret(cfg.outer.secret_file)
        except ValueError as error:
            raise ConfigError(str(error)) from None


def prepare_run(cfg: ExperimentConfig, groups: list[RegionConfig]) -> PreparedRun:
    """Every check that needs no cluster, in the order a user would fix them; writes nothing."""
    from ray_diloco.data.preflight import check_data
    from ray_diloco.tokenizer import load_tokenizer

    if cfg.run.name is None:
        raise ConfigError("run.name: give the run a name (--run-name)")
    check_job_stop_wait(cfg, os.environ.get(JOB_STOP_WAIT_ENV_VAR), in_ray_job())
    cfg.check_elastic()
    check_driver_ports(cfg)
    check_secret(cfg)
    cfg = resolve_paths(cfg)
    check_run_storage(cfg.run)  # another run's storage is refused before anything starts
    if cfg.run.resume and cfg.run.mode == "diloco":
        require_checkpoints(cfg)
    check_data(cfg.data, len(cfg.regions) if cfg.run.mode == "diloco" else len(groups), cfg.run.seed)
    if cfg.run.init_from:
        require_saved_model(cfg.run.init_from)
    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    except (OSError, ValueError) as error:
        raise ConfigError(f"data.tokenizer: {str(error).splitlines()[0]}") from None
    cfg = resolve_eval_every(resolve_vocab(cfg, tokenizer), groups)
    if cfg.run.init_from:
        check_init_from(cfg)
    results = ResultsDir.of(cfg.run.output_dir, cfg.run.name)
    # A URI is probed at the output directory, not the run's: pyarrow leaves a directory marker where it deleted the
    # probe, and the run's own prefix stays as it was until the run writes there.
    check_storage(cfg.run.output_dir if uris.is_uri(results.location) else results.location, "--output-dir")
    check_storage(cfg.run.checkpoint_root(), "--checkpoint-path")
    suffix = run_file_suffix(cfg)
    # A run that wrote results is another run's files, whatever its checkpoints; a config.yaml alone (a run
    # that failed before training) may be replaced. Checkpoints are compared in resume_plan.
    stored = results.read_text(f"config{suffix}.yaml")
    if stored is not None and results.exists(f"summary{suffix}.json"):
        check_continuation(stored, cfg, results.where(f"config{suffix}.yaml"))
    resume = resume_plan(cfg) if cfg.run.mode == "diloco" else {r.name: None for r in cfg.regions}
    return PreparedRun(cfg, tokenizer, results, suffix, resume)
