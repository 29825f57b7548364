"""What a run asks of the Ray cluster, checked before any actor or worker group starts.

Ray Train waits for resources that never come: on a cluster too small for the run, a worker group's start-up
times out and is retried forever (the job stays RUNNING). So the driver adds up what the run needs and
compares it with what the cluster has, or what its autoscaler can grow to, and stops at once with one line
saying what is needed, what is there, and which flag changes it.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ray_diloco.config import ConfigError, ExperimentConfig, RegionConfig

EVALUATOR_CPUS = 0.5  # the held-out evaluator: a forward pass over a few windows every eval_every outer steps


def run_needs(cfg: ExperimentConfig, groups: list[RegionConfig], at_most: bool = False) -> dict[str, dict[str, float]]:
    """Resource -> {what needs it: amount}, for the training groups of this driver: to start (an elastic region
    starts with its minimum worker count), or `at_most` (every region at its maximum)."""
    count = {g.name: g.max_workers if at_most else g.min_workers for g in groups}
    cpus = {f"{count[g.name]} worker(s) x {g.cpus_per_worker:g} CPU in {g.name}": count[g.name] * g.cpus_per_worker
            for g in groups}
    if cfg.run.mode == "diloco":
        cpus[f"{len(groups)} SyncActor(s) x {cfg.outer.sync_actor_cpus:g} (outer.sync_actor_cpus)"] = \
            len(groups) * cfg.outer.sync_actor_cpus
    if cfg.run.eval_every:
        cpus["the evaluator"] = EVALUATOR_CPUS
    cpus["Ray Data tasks (data.read_num_cpus)"] = cfg.data.read_num_cpus
    needs = {"CPU": cpus}
    gpus = {f"{count[g.name]} worker(s) x {g.gpus_per_worker:g} GPU in {g.name}": count[g.name] * g.gpus_per_worker
            for g in groups if g.gpus_per_worker}
    if gpus:
        needs["GPU"] = gpus
    return needs


def total(parts: dict[str, float]) -> float:
    return sum(parts.values())


# A private local Ray gives every worker a logical CPU of its own, cores or not (`local_cpus_for`): the workers
# take turns on the cores. Past this many per core (a judgement, not a measured threshold) a run only thrashes the
# machine (each worker is a process with torch, transformers and Ray loaded: 0.5 GB before its model, measured),
# and a stop then outlasts Ray's own timeouts. Only CPU training workers count: GPU workers are bounded by the
# machine's GPUs (`check_fits`), and the few processes per region beside them (SyncActor, data stream) are not what
# made such a run thrash.
LOCAL_WORKERS_PER_CORE = 8


def local_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may run on: a container's or `taskset`'s share, not the host's count
    (`docker --cpus 2` sets a cgroup quota, `cpu.max` "200000 100000", and leaves the affinity at every core)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open(cpu_max) as limits:
            quota, period = limits.read().split()[:2]
        return max(1, min(cores, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 file, or "max": no quota
        return cores


def check_local_machine(groups: list[RegionConfig], cores: int) -> None:
    """Raise ConfigError when a private local Ray would start more CPU training workers than this machine can
    take turns on (a range counts at its maximum: the private Ray is sized for it). A cluster attached with
    --address is sized by `check_cluster` instead."""
    workers = sum(g.max_workers for g in groups if not g.gpus_per_worker)
    limit = LOCAL_WORKERS_PER_CORE * cores
    if workers > limit:
        raise ConfigError(f"--workers-per-region: the run starts up to {workers} training workers (all regions of "
                          f"this driver) on this machine's {cores} core(s) through a private local Ray; more than "
                          f"{LOCAL_WORKERS_PER_CORE} per core ({limit}) only thrash it: lower --workers-per-region "
                          "(regions[].workers) or --regions, or run on a cluster (--address)")


def local_cpus_for(cfg: ExperimentConfig, groups: list[RegionConfig], cores: int) -> int:
    """Logical CPUs of a private local Ray: every worker and actor gets a slot even on a 2-core machine
    (they take turns on the cores; torch threads per worker are pinned)."""
    return max(cores, math.ceil(total(run_needs(cfg, groups, at_most=True)["CPU"]) - 1e-9))


def check_fits(needs: dict[str, dict[str, float]], have: dict[str, float],
               ceiling: dict[str, float] | None) -> None:
    """Raise ConfigError unless every resource the run needs is there now, or within the autoscaler's
    maximum (`ceiling`, None when the cluster does not autoscale)."""
    for resource, parts in needs.items():
        need = total(parts)
        limit = max(have.get(resource, 0.0), (ceiling or {}).get(resource, 0.0))
        if need <= limit + 1e-9:
            continue
        scales = " and cannot autoscale beyond it" if ceiling is None else " at most, autoscaling included"
        detail = ", ".join(f"{what} = {amount:g}" for what, amount in parts.items())
        fix = ("start Ray with more (`ray start --head --num-cpus N`: logical CPUs may exceed the cores), or lower "
               "--workers-per-region, regions[].cpus_per_worker or outer.sync_actor_cpus") if resource == "CPU" \
            else "use nodes with GPUs, or set regions[].gpus_per_worker: 0 to train on CPUs"
        raise ConfigError(f"the run needs {need:g} {resource} ({detail}) but the cluster has {limit:g}{scales}: "
                          f"{fix}")


def check_cluster(cfg: ExperimentConfig, groups: list[RegionConfig]) -> None:
    """`check_fits` against the connected Ray cluster."""
    import ray
    from ray._private import state  # Ray Train 2.60 reads the autoscaler's maximum the same way

    have: dict[str, Any] = ray.cluster_resources()
    ceiling = state.state.get_max_resources_from_cluster_config()
    check_fits(run_needs(cfg, groups), have, ceiling)
