"""The driver's Ray: attach to the cluster --address or RAY_ADDRESS names (a one-line error where none answers),
or start a private local Ray sized for the run, with the job's metadata for the dashboard."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

import ray
import torch

from ray_diloco.config import ConfigError, ExperimentConfig, RegionConfig
from ray_diloco.resources import check_fits, check_local_machine, local_cores, local_cpus_for, run_needs
from ray_diloco.run_setup import cluster_address

API_SERVER_ENV_VAR = "RAY_API_SERVER_ADDRESS"  # where Ray's State API clients look first


def connect_ray(address: str | None, cfg: ExperimentConfig, groups: list[RegionConfig],
                after_init: Callable[[], None] = lambda: None) -> None:
    """Attach to the cluster named by --address or RAY_ADDRESS (`ray job submit` sets it), else start a
    private local Ray sized for the run: never the `ray start` cluster of this machine by surprise
    (`ray.init()` would attach to it, and refuses `num_cpus` then)."""
    if ray.is_initialized():
        return
    named_by = "--address" if address else "RAY_ADDRESS"
    address = cluster_address(address)
    # WARNING: Ray's INFO start-up lines repeat what the driver prints below.
    quiet = dict(logging_level=logging.WARNING, include_dashboard=True, job_config=job_metadata(cfg, groups))
    if address:
        context = attach_ray(address, named_by, quiet)
        what = f"attached to the Ray cluster at {context.address_info.get('gcs_address', address)}"
    else:
        cores = local_cores()
        check_local_machine(groups, cores)  # again for callers of run_training (benchmarks, tests)
        cpus = local_cpus_for(cfg, groups, cores)
        # This machine is the whole cluster: a run it cannot hold (GPUs it lacks) fails before Ray starts.
        check_fits(run_needs(cfg, groups), {"CPU": cpus, "GPU": torch.cuda.device_count()}, None)
        context = start_private_ray(cpus, **quiet)
        what = "started a private local Ray (--address auto runs on a cluster `ray start` runs here)"
    after_init()  # ray.init installed its own SIGTERM handler: the caller's goes back at once
    dashboard = f"; dashboard http://{context.dashboard_url}" if context.dashboard_url else ""
    print(f"[driver] {what}{dashboard}", flush=True)


CLUSTER_ANSWER_SECONDS = 5.0  # how long a cluster's GCS port gets to accept a connection before ray.init


def attach_ray(address: str, named_by: str, init_args: dict):
    """`ray.init` on the cluster at `address` (`named_by`: the flag or variable that gave it), or a one-line
    ConfigError where there is none: ray.init would retry an unreachable GCS for about 30 s, log a line at each try,
    and end in a traceback. A `host:port` address (IPv6 in brackets) is tried first with a plain connection."""
    host, _, port = address.rpartition(":")
    if host and port.isdigit() and "://" not in address:
        error = unanswered(host.strip("[]"), int(port))
        if error is not None:
            raise ConfigError(f"{named_by} {address}: no Ray cluster answers there ({error.strerror or error}); "
                              "give the head's address (`ray status` on the head prints it), or leave it out for a "
                              "private local Ray") from None
    try:
        return ray.init(address=address, **init_args)
    except ConnectionError as error:  # `auto` with no `ray start` cluster on this machine, a cluster gone
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        raise ConfigError(f"{named_by} {address}: {first_line} (start one with `ray start --head`, or leave it "
                          "out for a private local Ray)") from error


LOOPBACK = ("localhost", "127.0.0.1", "::1")


def unanswered(host: str, port: int) -> OSError | None:
    """Why nothing accepts a connection at host:port (None: something does). Ray connects to this node's own
    address in place of a loopback one, so that is tried too."""
    hosts = [host] + ([ray.util.get_node_ip_address()] if host in LOOPBACK else [])
    error = None
    for candidate in hosts:
        try:
            socket.create_connection((candidate, port), timeout=CLUSTER_ANSWER_SECONDS).close()
            return None
        except OSError as refused:
            error = error or refused
    return error


def start_private_ray(num_cpus: int, **init_args):
    """A local Ray of our own, with the dashboard: users watch the run there, and Ray Train's placement-group
    cleaner needs its State API. That cleaner finds the State API through RAY_API_SERVER_ADDRESS, else through
    the `ray start` cluster recorded under /tmp/ray: where one runs, it would ask that cluster whether our
    Train controller is alive, hear "no such actor" and remove our workers' placement group. So the cluster's
    processes, which inherit the environment at start, get our dashboard's address."""
    port = _free_port()
    previous = os.environ.get(API_SERVER_ENV_VAR)
    os.environ[API_SERVER_ENV_VAR] = f"http://127.0.0.1:{port}"
    try:
        return ray.init(address="local", num_cpus=num_cpus, dashboard_port=port, **init_args)
    finally:  # only the cluster's processes need it; this process may start other clusters later
        if previous is None:
            os.environ.pop(API_SERVER_ENV_VAR, None)
        else:
            os.environ[API_SERVER_ENV_VAR] = previous


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def job_metadata(cfg: ExperimentConfig, groups: list[RegionConfig]) -> ray.job_config.JobConfig:
    """What the dashboard's Jobs page shows beside the job (under `ray job submit`, merged with the
    submission's `--metadata-json`)."""
    return ray.job_config.JobConfig(metadata={
        "ray_diloco_run": cfg.run.name or "", "mode": cfg.run.mode,
        "regions": ",".join(f"{g.name}:{g.workers}" for g in groups),
        "model": f"d{cfg.model.hidden_size}-L{cfg.model.num_layers}",
        "steps": f"H={cfg.outer.inner_steps} T={cfg.run.outer_steps}"})
