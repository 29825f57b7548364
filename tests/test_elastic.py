"""One Ray cluster per region: an elastic region (`workers: 1..2`) on a multi-node Ray cluster that loses a node
and gets it back, a second region in a Ray of its own, and a third that starts mid-run and joins.

`ray.cluster_utils.Cluster` runs a head and two worker nodes on this machine (real raylets). Region us runs there
with 2 CPUs per worker, so only the worker nodes have room for its workers (the head has 1 CPU: SyncActor, data
tasks); region eu runs beside it in a Ray of its own (a second `ray-diloco train --local-regions eu`), and the two
meet over Hivemind through the shared storage's peer files (no `--initial-peers`). Mid-run a worker node is removed
(scale-in: Ray Train restarts the group with the 1 worker there is room for, from the last checkpoint) and added
again (scale-out: Ray Train's elastic policy sees room for 2 and restarts the group bigger); between the two, a
third cluster starts (region ap, `--local-regions ap`, its own Ray) and joins from the others' state. Checks that:
* the run finishes, us, eu and ap agree bit for bit at the end; ap joined (`region_joined`) at a later outer step;
* the three regions read disjoint file lists;
* summary.json's events record both resizes (`group_resized`, 2 -> 1 and 1 -> 2, with the outer step);
* us's data fingerprint equals that of the first N windows of its stream (N: the windows it trained on): no
  window twice and none skipped across the resizes;
* the worker checkpoint written by 2 workers was loaded by 1 (re-sharded).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml
from ray.cluster_utils import Cluster

from conftest import RunInThread, wait_for
from ray_diloco.batches import window_fingerprint
from ray_diloco.config import ExperimentConfig
from ray_diloco.data.pipeline import build_region_datasets
from ray_diloco.driver import run_training
from ray_diloco.presets import tiny_cpu

OUTER_STEPS = 9


def run_yaml(tmp_path: Path) -> Path:
    cfg = tiny_cpu().to_dict()
    cfg["regions"] = [{"name": "us", "workers": "1..2", "cpus_per_worker": 2}, {"name": "eu", "workers": 1},
                      {"name": "ap", "workers": 1}]
    cfg["outer"].update(inner_steps=4, max_wait_seconds=240, matchmaking_seconds=5, averaging_timeout=120)
    cfg["inner"]["warmup_steps"] = 2
    cfg["run"].update(name="elastic", outer_steps=OUTER_STEPS, checkpoint_every=1, eval_every=0, max_failures=4,
                      resize_check_seconds=5, output_dir=str(tmp_path / "out"),
                      checkpoint_path=str(tmp_path / "bucket"))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_region(config: Path, region: str, log: Path) -> subprocess.Popen:
    """A cluster of its own for `region`: `ray-diloco train` starts a private Ray."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen([sys.executable, "-m", "ray_diloco.cli", "train", "--config", str(config),
                             "--local-regions", region], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def events_of(actor, kind):
    return [e for e in ray.get(actor.stats.remote())["events"] if e["event"] == kind]


def first_windows_fingerprint(cfg: ExperimentConfig, windows: int) -> str:
    """The fingerprint of the first `windows` windows of us's stream, read straight from its dataset (in a Ray of
    its own, shut down after: the run's clusters are gone, and Ray Data would start one that outlives the test)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        (dataset,) = build_region_datasets(cfg.data, len(cfg.regions), cfg.run.seed, indices=[0])
        dataset.context.execution_options.preserve_order = True
        total, seen = 0, 0
        while seen < windows:  # epoch after epoch, as the region reads it
            for batch in dataset.iter_batches(batch_size=cfg.data.batch_size, batch_format="numpy",
                                              drop_last=True):
                total += window_fingerprint(batch["input_ids"])
                seen += len(batch["input_ids"])
                if seen == windows:
                    break
    finally:
        ray.shutdown()
    return f"{total % 2**64:016x}"


@pytest.mark.timeout(1500)
def test_an_elastic_region_scales_in_and_out_and_trains_every_window_once(tmp_path):
    config = run_yaml(tmp_path)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    others: dict[str, subprocess.Popen] = {}
    try:
        cfg = ExperimentConfig.from_yaml(config.read_text())
        us_cfg = ExperimentConfig.from_dict({**cfg.to_dict(), "run": {**cfg.to_dict()["run"],
                                                                      "local_regions": ["us"]}})
        run = RunInThread(lambda: run_training(us_cfg, address=cluster.address))
        # Not ray.get_actor before the driver has connected: it would start a Ray of its own.
        wait_for(lambda: ray.is_initialized() and _actor("elastic", "us") is not None, 300, "us's SyncActor")
        actor = _actor("elastic", "us")
        # After us is up: a region never seen is not waited for.
        others["eu"] = start_region(config, "eu", tmp_path / "eu.log")
        committed = tmp_path / "bucket" / "elastic" / "checkpoints" / "us" / "outer-000002" / "COMMITTED"
        wait_for(committed.exists, 600, "us's checkpoint of outer step 2, written by 2 workers")
        assert len(ray.get(actor.worker_pids.remote())) == 2
        cluster.remove_node(workers.pop())  # scale-in: a node (and the worker on it) is gone
        wait_for(lambda: events_of(actor, "group_resized"), 600, "the group restarted with 1 worker")
        shrunk = ray.get(actor.outer_step.remote())
        others["ap"] = start_region(config, "ap", tmp_path / "ap.log")  # a third cluster, mid-run
        wait_for(lambda: ray.get(actor.outer_step.remote()) >= shrunk + 1, 600, "a round with 1 worker")
        workers.append(cluster.add_node(num_cpus=2))  # scale-out: room for a second worker again
        wait_for(lambda: len(events_of(actor, "group_resized")) >= 2, 600, "the group grew back to 2 workers")
        summary = run.join(900)
        for region, process in others.items():
            assert process.wait(timeout=600) == 0, (tmp_path / f"{region}.log").read_text()[-3000:]
    finally:
        for process in others.values():
            if process.poll() is None:
                process.kill()
        ray.shutdown()
        cluster.shutdown()

    resized = [(e["from_workers"], e["to_workers"]) for e in summary["events"] if e["event"] == "group_resized"]
    assert resized[:2] == [(2, 1), (1, 2)], summary["events"]
    assert all(e["outer_step"] >= 2 for e in summary["events"] if e["event"] == "group_resized")
    results = tmp_path / "out" / "elastic"
    theirs = {region: json.loads((results / f"summary-{region}.json").read_text()) for region in ("eu", "ap")}
    digests = {summary["global_digest"]["us"], *(theirs[r]["global_digest"][r] for r in theirs)}
    assert len(digests) == 1, digests  # bit for bit at the end, in all three clusters
    joined = [e for e in theirs["ap"]["events"] if e["event"] == "region_joined"]
    assert joined and joined[0]["to_step"] >= 2, theirs["ap"]["events"]  # from the others' state, mid-run
    files = [set(summary["data_files"]["us"]), *(set(theirs[r]["data_files"][r]) for r in theirs)]
    assert all(files) and sum(len(f) for f in files) == len(set().union(*files)), files  # disjoint
    assert summary["outer_steps"] == OUTER_STEPS and not summary["disagreeing_regions"]
    data = summary["data_fingerprint"]["us"]
    # Every round trained H steps of 1 batch per worker; the fingerprint is of exactly the first N windows.
    assert data["windows"] >= OUTER_STEPS * 4 * cfg.data.batch_size
    assert data["fingerprint"] == first_windows_fingerprint(cfg, data["windows"])
    # The scale-in came after a checkpoint: 1 worker loaded the AdamW state 2 wrote (re-sharded). The scale-out
    # comes whenever Ray Train looks: it loads a checkpoint or, between a round and its checkpoint, starts the
    # inner state anew (both are events).
    after_scale_in = [e["event"] for e in summary["events"] if e["event"].startswith("inner_state_")]
    assert after_scale_in[0] == "inner_state_restored", summary["events"]


def _actor(run: str, region: str):
    try:
        return ray.get_actor(f"diloco-sync-{run}-{region}")
    except ValueError:
        return None
