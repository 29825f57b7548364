"""The driver of a multi-region DiLoCo run: starts one SyncActor and one Ray Train group per region,
runs the regions concurrently, evaluates θ_global before and after, and writes `summary.json`.

It runs wherever `ray job submit` or `ray-diloco train` starts it; the work itself happens in actors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_diloco.actor_by_name import ActorByName
from ray_diloco.checkpoint import CheckpointStore, join
from ray_diloco.config import ConfigError, ExperimentConfig, RegionConfig
from ray_diloco.data.eval_set import evaluate_loss, load_eval_windows
from ray_diloco.data.pipeline import DataCounters, region_dataset_recipes
from ray_diloco.data.stream import RegionStream
from ray_diloco import metrics
from ray_diloco.evaluator import Evaluator
from ray_diloco.live_summary import LiveSummary
from ray_diloco.model import build_model, count_parameters, load_parameters, save_model
from ray_diloco.network import reach_warning, region_network
from ray_diloco.outcome import (TrainingOutcome, baseline_outcome, build_summary, canonical_index,
                                finished_elsewhere)
from ray_diloco.plots import write_loss_png
from ray_diloco.ray_connection import connect_ray
from ray_diloco.resources import EVALUATOR_CPUS, check_cluster
from ray_diloco.run_setup import PreparedRun, prepare_run, resume_plan, training_groups
from ray_diloco.run_storage import held_regions
from ray_diloco.methods.settings import describe_outer
from ray_diloco.lifecycle import RELEASE_SECONDS, RegionAborted, end_actors, fit_in_background, wait_for_groups
from ray_diloco.stopping import RunStop, RunStopped
from ray_diloco.sync.actor import SyncActor
from ray_diloco.sync.secret import read_secret
from ray_diloco.worker import region_train_loop

logger = logging.getLogger(__name__)

REGION_LABEL = "ray.io/availability-region"
# How long the driver waits for what its actors report at the end (stats, θ_global, the evaluation curve): an
# answer queued behind a slow evaluation must not hold a stopped driver past Ray's stop wait.
RESULT_SECONDS = 120.0
STREAM_PREPARE_SECONDS = 60.0  # how long start-up waits for the region streams to list their data
def region_placement(region: RegionConfig) -> dict[str, str] | None:
    """Pin a region to nodes labelled with its name, when the cluster defines regions."""
    labelled = {node.get("Labels", {}).get(REGION_LABEL) for node in ray.nodes() if node.get("Alive")}
    return {REGION_LABEL: region.name} if region.name in labelled else None


def on_driver_node() -> dict[str, Any]:
    """Actor options that keep an actor on the driver's node (the head, under `ray job submit`): worker nodes come
    and go with the autoscaler, and an actor that holds run state must not go with them. Not soft: Ray's soft
    affinity placed actors on worker nodes while the head had room (seen with 3 nodes here)."""
    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


def check_elastic_region(cfg: ExperimentConfig, groups: list[RegionConfig]) -> None:
    """An elastic region needs a Ray cluster of its own region (Ray Train sizes the group on every node of the
    cluster, labels or not) and room on the driver's node for what stays there (`actor_placement`)."""
    for group in (g for g in groups if g.elastic):
        where = f"regions[{group.name}].workers"
        others = sorted({n.get("Labels", {}).get(REGION_LABEL) for n in ray.nodes() if n.get("Alive")}
                        - {group.name, None})
        if others:
            raise ConfigError(f"{where}: a range ({group.workers}) needs a Ray cluster of its own, but this one has "
                              f"nodes of regions {others}: give a fixed worker count here")
        node = ray.get_runtime_context().get_node_id()
        cpus = next(n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["NodeID"] == node)
        need = cfg.outer.sync_actor_cpus + (EVALUATOR_CPUS if cfg.run.eval_every else 0.0)
        if cpus < need:
            raise ConfigError(f"{where}: an elastic region keeps its SyncActor (and the evaluator) on the driver's "
                              f"node, which has {cpus:g} CPU of the {need:g} they need: give the head CPUs "
                              f"(`ray start --head --num-cpus {math.ceil(need)}` or more)")
        if cfg.run.checkpoint_every != 1:
            print(f"[driver] warning: {group.name} is elastic and run.checkpoint_every is "
                  f"{cfg.run.checkpoint_every}: a resize between checkpoints (a scale-up, a node lost without "
                  "notice; a preemption's notice makes its own) starts its inner AdamW state anew "
                  "(run.checkpoint_every: 1 keeps it)", flush=True)


def actor_placement(region: RegionConfig, pinned: bool = False) -> dict[str, Any]:
    """Where a region's SyncActor and RegionStream run: beside the driver when the region is elastic (its worker
    nodes come and go; the SyncActor holds the region's outer state) or `pinned` (the SyncActor's address is
    fixed: a port or announced address names the driver's node), else on the region's labelled nodes when the
    cluster defines regions."""
    if region.elastic or pinned:
        return on_driver_node()
    selector = region_placement(region)
    return {"label_selector": selector} if selector else {}


def run_actor_name(kind: str, cfg: ExperimentConfig, region: str | None = None) -> str:
    """The Ray name of a run-scoped actor (`sync`, `stream`: per region; `eval`, `data`: per driver, `region` then
    names the driver's regions joined by '+'): every process of a run can be found by it (the dashboard's Actors
    page, `ray list actors`, tests that check none outlives the run)."""
    return f"diloco-{kind}-{cfg.run.name}" + (f"-{region}" if region else "")


def start_sync_actors(cfg: ExperimentConfig, resume: dict[str, int | None], record_rounds: bool = False,
                      evaluator: Any = None) -> list[Any]:
    """The first region's actor bootstraps the DHT; the others join it with its multiaddrs, started at once (each
    waits for them only to join: building its state overlaps the first's start). `resume`: the outer step each
    region continues from (None: a fresh start)."""
    actors, peers, first_multiaddrs = [], list(cfg.outer.initial_peers), None  # the first's, where others wait
    config = cfg.to_dict()
    # The bytes, not the path: a SyncActor may run on another node. Never in the config, a log or a summary.
    secret = read_secret(cfg.outer.secret_file) if cfg.outer.secret_file else None
    if any(step is not None for step in resume.values()):
        print(f"[driver] continuing run {cfg.run.name} from outer steps {resume} (checkpoints under "
              f"{cfg.run.checkpoint_root()})", flush=True)
    try:
        for region in cfg.local_regions():
            step = resume[region.name]
            pinned = region_network(cfg, region.name).pinned
            options: dict[str, Any] = {"name": run_actor_name("sync", cfg, region.name),
                                       "num_cpus": cfg.outer.sync_actor_cpus, **actor_placement(region, pinned)}
            # One evaluator for the run: θ_global is the same in every region.
            actor = SyncActor.options(**options).remote(
                config, region.name, peers, record_rounds, evaluator if not actors else None, step, secret,
                [first_multiaddrs] if first_multiaddrs is not None else None)
            if len(actors) == 0 and not peers and len(cfg.local_regions()) > 1:
                first_multiaddrs = actor.multiaddrs.remote()
            actors.append(actor)
        ray.get([a.catch_up.remote() for a in actors])  # surfaces start-up errors here too
        if len(cfg.local_regions()) < len(cfg.regions) or cfg.outer.initial_peers:  # regions in other clusters
            warn_about_reach(cfg, actors, secret)
    except BaseException:
        # The caller gets no handle to end them by: the ones that started (their Hivemind running) end here,
        # or they outlive the failed start in any driver process that lives on.
        end_actors([(a, "shutdown") for a in actors])
        raise
    return actors


def warn_about_reach(cfg: ExperimentConfig, actors: list[Any], secret: bytes | None) -> None:
    """Where regions of other clusters take part: say what would let outsiders in or keep those regions out."""
    if secret is None:
        print(f"[driver] warning: run {cfg.run.name} has no secret: anyone who reaches a region's Hivemind port "
              "and knows the run's name can take part; give every region --secret-file (README: threat model)",
              flush=True)
    for region, actor in zip(cfg.local_regions(), actors):
        if warning := reach_warning(region.name, ray.get(actor.multiaddrs.remote())):
            print(warning, flush=True)


def start_streams(cfg: ExperimentConfig, groups: list[RegionConfig], recipes: list[Any], counters: Any) -> list[Any]:
    """One `RegionStream` per group: the one reader of its region's data, on the region's nodes, building its
    dataset from its recipe. Not Ray Train's dataset split: a rank's rows there depend on the worker count, and
    an elastic group changes it."""
    streams = []
    try:
        for group, make_dataset in zip(groups, recipes):
            options = {"name": run_actor_name("stream", cfg, group.name), **actor_placement(group)}
            streams.append(RegionStream.options(**options).remote(make_dataset, cfg.data.batch_size, counters))
        # A region's unreadable data fails the run here, before training. A stream whose nodes are not up yet (an
        # autoscaler starting them) is not waited for: it builds its dataset at its first batch.
        prepared = [stream.prepare.remote() for stream in streams]
        ready, _ = ray.wait(prepared, num_returns=len(prepared), timeout=STREAM_PREPARE_SECONDS)
        ray.get(ready)
    except BaseException:  # (a stop during start-up too) the caller gets no handle to end them by
        end_actors([(s, "close") for s in streams])
        raise
    return streams


def make_trainer(cfg: ExperimentConfig, group: RegionConfig, evaluator: str | None) -> TorchTrainer:
    """The region's Ray Train group. Its workers find the run's actors by name (`worker.run_actors`): an actor
    handle in `train_loop_config` would make Ray Train's controller import the actor's module to unpickle it (hivemind,
    transformers: seconds of CPU and ~150 MB in a process that never calls it)."""
    selector = region_placement(group)
    resources = {"CPU": group.cpus_per_worker}
    if group.gpus_per_worker:
        resources["GPU"] = group.gpus_per_worker
    experiment = f"{cfg.run.name}-{group.name}"  # the Ray Train run: its name on the dashboard
    return TorchTrainer(
        region_train_loop,
        train_loop_config={"experiment": cfg.to_dict(), "region": group.name,
                           "namespace": ray.get_runtime_context().namespace,
                           "sync_actor": run_actor_name("sync", cfg, group.name) if cfg.run.mode == "diloco" else None,
                           "evaluator": evaluator, "stream": run_actor_name("stream", cfg, group.name),
                           "threads_per_worker": max(1, int(group.cpus_per_worker)),
                           "worker_checkpoints": join(cfg.run.checkpoint_root(), experiment)},
        # A range lets Ray Train (re)start the group with the workers the cluster has room for (elastic).
        scaling_config=ScalingConfig(num_workers=(group.min_workers, group.max_workers) if group.elastic
                                     else group.workers, use_gpu=group.gpus_per_worker > 0,
                                     elastic_resize_monitor_interval_s=cfg.run.resize_check_seconds,
                                     resources_per_worker=resources, label_selector=selector),
        run_config=RunConfig(name=experiment, storage_path=cfg.run.checkpoint_root(),
                             # A preempted node is not a failure: Ray Train restarts the group on what is left
                             # however often (ray_diloco/preemption.py says what the group does before that).
                             failure_config=FailureConfig(max_failures=cfg.run.max_failures,
                                                          max_preemption_failures=-1),
                             checkpoint_config=worker_checkpoint_config()),
    )


def worker_checkpoint_config() -> CheckpointConfig:
    """Ray Train keeps the newest reports (each save a directory of its own) and deletes the older ones, across
    a run's restarts (it reloads its list, and refuses to start if a listed directory is gone: so only Ray Train
    deletes them). The SyncActor keeps its two newest outer checkpoints, each naming one report; three times as
    many reports leave room for saves not followed by a commit (a failed commit, a group killed between the two, a
    step trained again after a restart, the save at a hand-in under a preemption notice followed by one after an
    abandoned round)."""
    return CheckpointConfig(num_to_keep=3 * CheckpointStore.keep_default)


def evaluate_state(cfg: ExperimentConfig, model, state: dict | None, windows) -> tuple[float, float]:
    if state is not None:
        load_parameters(model, state)
    return evaluate_loss(model, windows, cfg.data.batch_size)


def run_training(cfg: ExperimentConfig, address: str | None = None,
                 before_shutdown: Callable[[list[Any]], None] | None = None,
                 prepared: PreparedRun | None = None, stop: RunStop | None = None) -> dict[str, Any]:
    """Train `cfg` in its mode (diloco, ddp or single); returns (and writes) the summary.

    Every input is checked before Ray starts (`prepared`: the CLI checks before importing this module), and
    the cluster's resources before any actor starts. `before_shutdown(actors)` sees the SyncActors after
    training (tests read recorded rounds there; passing it makes the actors record every round's θ_region).
    SIGTERM and SIGINT are handled from the first line to the last (`RunStop`; the CLI passes the one it installed
    before its own checks; a test driving a run from a thread passes one it aborts): a stop before training raises
    `RunStopped`; one during training ends it at an outer-step boundary; one after training lets it finish."""
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stop = stack.enter_context(contextlib.nullcontext(stop) if stop is not None else RunStop())
        stop.timeout = cfg.run.stop_timeout_seconds
        groups = training_groups(cfg)
        prepared = prepared or prepare_run(cfg, groups)
        cfg, results = prepared.cfg, prepared.results
        try:
            connect_ray(address, cfg, groups, after_init=stop.reinstall)
        except SystemExit as exit_:  # ray.init's own SIGTERM handler, before ours is back in place
            raise RunStopped("stopped on request before training started: Ray was starting") from exit_
        check_cluster(cfg, groups)
        check_elastic_region(cfg, groups)
        # One driver per region: a second one refuses here, in one line, before anything is written or started.
        took_over = stack.enter_context(held_regions(cfg.run, [g.name for g in groups], lambda region: stop.abort(
            f"region {region}: another driver took over its lease")))
        if took_over and cfg.run.mode == "diloco":  # the previous driver may have committed since it was planned
            prepared = dataclasses.replace(prepared, resume=resume_plan(cfg))
        results.write(f"config{prepared.suffix}.yaml", lambda path: path.write_text(cfg.to_yaml()))
        print(f"[driver] run {cfg.run.name}: results in {results.location}, checkpoints in {cfg.run.checkpoint_root()}",
              flush=True)

        windows = load_eval_windows(cfg.data, prepared.tokenizer)
        model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, cfg.run.seed, cfg.run.init_from)
        num_params = count_parameters(model)
        eval_start, _ = evaluate_state(cfg, model, None, windows)
        outer = f"; {describe_outer(cfg.outer)}" if cfg.run.mode == "diloco" else ""
        print(f"[driver] mode {cfg.run.mode}: {len(groups)} group(s) {[(g.name, g.workers) for g in groups]}, "
              f"{num_params:,} parameters; held-out loss at start {eval_start:.4f}{outer}", flush=True)
        stop.raise_if_requested()
        outcome = train_groups(cfg, groups, prepared.resume, windows, num_params, before_shutdown, stop)
        stop.finish()  # from here a signal waits for the export and summary
        return finish_run(cfg, groups, prepared, model, windows, outcome, eval_start, num_params,
                          time.perf_counter() - started)


def finish_run(cfg: ExperimentConfig, groups: list[RegionConfig], prepared: PreparedRun, model, windows,
               outcome: "TrainingOutcome", eval_start: float, num_params: int, wall: float) -> dict[str, Any]:
    """The final evaluation of the exported θ_global, the model directory, summary.json and loss.png."""
    results = prepared.results
    eval_loss, eval_ppl = evaluate_state(cfg, model, outcome.final_state, windows)
    # The dashboards' held-out panels get the end's evaluation too (a run with no mid-run one had none).
    metrics.safely(metrics.record_eval, cfg.run.name, outcome.final_outer_step(), eval_loss, eval_ppl)
    results.write("model", lambda path: save_model(model, outcome.final_state, path, prepared.tokenizer))
    outcome.finished_elsewhere = finished_elsewhere(cfg, groups)
    summary = build_summary(cfg, groups, outcome, eval_start, eval_loss, eval_ppl, wall, num_params)
    summary_text = json.dumps(summary, indent=2)
    summary_file = results.write(f"summary{prepared.suffix}.json", lambda path: path.write_text(summary_text))
    loss_png = results.write(f"loss{prepared.suffix}.png", lambda path: write_loss_png(summary, path))
    if summary["stopped"]:
        steps = sorted({w["outer_step"] for w in outcome.worker_results})
        print(f"[driver] stopped on request at outer step(s) {steps} of {cfg.run.outer_steps}, checkpointed: "
              f"start it again with --run-name {cfg.run.name} to continue", flush=True)
    print(f"[driver] held-out loss {eval_start:.4f} -> {eval_loss:.4f} (perplexity {eval_ppl:.1f}); "
          f"global model identical across regions: {summary['regions_agree']}; summary: {summary_file}",
          flush=True)
    if loss_png is not None:
        print(f"[driver] loss curves: {loss_png}", flush=True)
    return summary


def train_groups(cfg: ExperimentConfig, groups: list[RegionConfig], resume: dict[str, int | None], windows,
                 num_params: int, before_shutdown: Callable[[list[Any]], None] | None,
                 stop: RunStop | None = None) -> TrainingOutcome:
    """Start the run-scoped actors and one Ray Train group per region (or baseline group), wait for them. Every
    actor started here is ended here, whatever happens (`lifecycle.release`)."""
    actors: list[Any] = [None] * len(groups)
    streams: list[Any] = []
    evaluator = live = None
    # This driver's regions in the name: a second driver of the run in the same cluster (a region joining from
    # another config) has its own counters and evaluator.
    drivers_regions = "+".join(g.name for g in groups)
    counters_name = run_actor_name("data", cfg, drivers_regions)
    counters = DataCounters.options(name=counters_name, **on_driver_node()).remote()
    # Its readers get its name, not this handle (a handle in a RegionStream's arguments makes Ray log an error).
    counters_by_name = ActorByName(counters_name)
    try:
        recipes = dataset_recipes(cfg, groups, counters_by_name)
        # Beside the driver where nodes come and go (an elastic region); anywhere else (it needs a CPU share).
        placement = on_driver_node() if any(g.elastic for g in groups) else {}
        if cfg.run.eval_every:
            evaluator = Evaluator.options(name=run_actor_name("eval", cfg, drivers_regions), num_cpus=EVALUATOR_CPUS,
                                          **placement).remote(cfg.to_dict(), windows)
        if cfg.run.mode == "diloco":
            actors = start_sync_actors(cfg, resume, record_rounds=before_shutdown is not None, evaluator=evaluator)
            live = LiveSummary([g.name for g in groups], actors, evaluator, cfg.run.outer_steps,
                               patience=2 * cfg.outer.matchmaking_seconds)
        streams = start_streams(cfg, groups, recipes, counters_by_name)
        evaluator_name = run_actor_name("eval", cfg, drivers_regions) if evaluator is not None else None
        trainers = [make_trainer(cfg, group, evaluator_name) for group in groups]
        if stop is not None:
            stop.start_training(actors)
        # Each fit() blocks until its group finishes; regions meet only in their SyncActors.
        futures = [fit_in_background(_fit, t, a, g.name) for t, a, g in zip(trainers, actors, groups)]
        outcomes = wait_for_groups(futures, [g.name for g in groups], stop)
        return collect_outcome(cfg, groups, actors, outcomes, num_params, before_shutdown, evaluator, counters)
    finally:
        if live is not None:
            live.stop()
        # Each ends itself first (Hivemind's processes, Ray Data's reader threads), then is killed, then waited
        # for: a run leaves no process behind (a RegionStream once outlived its run by minutes).
        left = end_actors([(a, "shutdown") for a in actors] + [(s, "close") for s in streams]
                          + [(evaluator, None), (counters, None)])
        if left:
            logger.warning("%d actor(s) of run %s still alive %.0f s after the run", len(left), cfg.run.name,
                           RELEASE_SECONDS)


def dataset_recipes(cfg: ExperimentConfig, groups: list[RegionConfig], counters: Any) -> list[Any]:
    """Each group's dataset recipe (`pipeline.region_dataset_recipes`)."""
    if cfg.run.mode == "diloco":  # the split follows the run's full region list (other clusters run the rest)
        names = [r.name for r in cfg.regions]
        return region_dataset_recipes(cfg.data, len(names), cfg.run.seed, counters,
                                      [names.index(g.name) for g in groups])
    return region_dataset_recipes(cfg.data, len(groups), cfg.run.seed, counters)


def collect_outcome(cfg: ExperimentConfig, groups: list[RegionConfig], actors: list[Any], outcomes: list,
                    num_params: int, before_shutdown, evaluator: Any, counters: Any) -> TrainingOutcome:
    """What the finished groups report. A region whose group failed for good (after its restarts) or was aborted
    by a stop has left the run; the others went on. None finished: the run failed (or, aborted, stopped)."""
    finished = [i for i, (_, error) in enumerate(outcomes) if error is None]
    failed = [groups[i].name for i in range(len(groups)) if i not in finished]
    if not finished or (cfg.run.mode != "diloco" and failed):
        errors = [e for _, e in outcomes if e is not None]
        if errors and all(isinstance(e, RegionAborted) for e in errors):
            raise RunStopped(f"stopped on request: aborted the training of {failed} (no outer-step boundary in "
                             f"time); {last_checkpoints(cfg, groups)}")
        raise RuntimeError(f"training failed in {failed}") from errors[0]
    departures = [{"event": "region_aborted" if isinstance(outcomes[i][1], RegionAborted) else "region_departed",
                   "region": groups[i].name, "time": time.time(),
                   "error": str(outcomes[i][1]).splitlines()[0][:300]} for i in range(len(groups)) if i not in finished]
    for departure in departures:
        logger.warning("region %s left the run: %s", departure["region"], departure["error"])
        metrics.safely(metrics.record_event, cfg.run.name, departure["region"], departure["event"])
    if any(d["event"] == "region_aborted" for d in departures):
        print(f"[driver] stop: {last_checkpoints(cfg, groups)}", flush=True)
    worker_results = [outcomes[i][0].return_value for i in finished]
    if cfg.run.mode == "diloco":
        stats = ray.get([actors[i].stats.remote() for i in finished], timeout=RESULT_SECONDS)
        stats[0].setdefault("events", []).extend(departures)
        exported = canonical_index(stats)  # not simply the first region: the state every region would adopt
        final_state = ray.get(actors[finished[exported]].global_state.remote(), timeout=RESULT_SECONDS)
        if before_shutdown is not None:
            before_shutdown(actors)
    else:
        final_state, stats = baseline_outcome(cfg, groups[0], worker_results[0], num_params)
    curve = ray.get(evaluator.get_curve.remote(), timeout=RESULT_SECONDS) if evaluator else []
    data_counts = ray.get(counters.get.remote(), timeout=RESULT_SECONDS)
    metrics.safely(metrics.record_skipped_records, cfg.run.name, data_counts["skipped"])
    return TrainingOutcome(stats, worker_results, finished, final_state, curve, data_counts)


def last_checkpoints(cfg: ExperimentConfig, groups: list[RegionConfig]) -> str:
    """Each region's last committed outer checkpoint, as one clause ('none' where there is none)."""
    if cfg.run.mode != "diloco":
        return "ddp and single runs keep no checkpoints"
    from ray_diloco.checkpoint import CheckpointStore

    parts = []
    for group in groups:
        try:
            step = CheckpointStore(join(cfg.run.checkpoint_root(), group.name)).latest_step()
        except Exception as error:  # the message must still be printed
            step = f"unknown ({type(error).__name__})"
        parts.append(f"{group.name}: {'none' if step is None else f'outer step {step}'}")
    return (f"last committed checkpoints {{{', '.join(parts)}}} under {cfg.run.checkpoint_root()}; start it again "
            f"with --run-name {cfg.run.name} to continue")


def _fit(trainer: TorchTrainer, actor: Any = None) -> tuple[Any, BaseException | None]:
    """Ray Train V2's fit() raises when the group fails for good; a region's failure is an outcome here. Its
    SyncActor then leaves the run at once (withdraws its record): the other regions stop waiting for it."""
    try:
        result = trainer.fit()
        outcome = result, result.error
    except Exception as error:
        outcome = None, error
    if outcome[1] is not None and actor is not None:
        actor.shutdown.remote()
    return outcome
