"""Two regions in one Ray cluster whose worker nodes carry region labels (`ray.io/availability-region`, as
`cluster/` sets them): each region's training worker, SyncActor and data reader (RegionStream) run on the node
labelled with its name, though the unlabelled head has room for all of them and the other region's node for some.
(One look, once every one of them is up.)

The nodes are started by Ray's autoscaler (tests/autoscaling_head.py): one node type per region, at least and at
most one node each, labelled through the node type's `labels`, as a cluster YAML of the README's would. The driver
finds the labels on the cluster's nodes and gives each region's Ray Train group (`ScalingConfig.label_selector`)
and actors the region's label selector (`ray_diloco.driver.region_placement`). The driver is `ray-diloco train
--address <head>` in a process of its own; the test process only watches (conftest.Driver says why).
"""

import dataclasses
import json

import ray
from ray.util.state import list_actors, list_workers

from autoscaling_head import AutoscalingHead, NodeType, watching
from conftest import TEST_DATA, Driver, driver_env, named_actor, wait_for
from ray_diloco.config import RegionConfig
from ray_diloco.driver import REGION_LABEL, run_actor_name
from ray_diloco.presets import tiny_cpu

REGIONS = ("us", "eu")
OUTER_STEPS = 4  # long enough to be looked at while it runs
LAST_LOOK: dict[str, dict] = {}  # what the last look at a region found missing (for a timeout's message)


def labelled_run(tmp_path):
    cfg = tiny_cpu()
    return dataclasses.replace(
        cfg, regions=[RegionConfig(name=name, workers=1) for name in REGIONS],
        data=dataclasses.replace(cfg.data, **TEST_DATA),
        inner=dataclasses.replace(cfg.inner, warmup_steps=2),
        outer=dataclasses.replace(cfg.outer, inner_steps=4, matchmaking_seconds=5.0),
        run=dataclasses.replace(cfg.run, name="labels", outer_steps=OUTER_STEPS, eval_every=0,
                                output_dir=str(tmp_path)))


def test_each_region_runs_on_the_nodes_labelled_with_its_name(tmp_path):
    cfg = labelled_run(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(cfg.to_yaml())
    # 3 CPUs a node: a region's worker (1), SyncActor (0.5) and data tasks fit on its own node, and the worker or
    # SyncActor of the other region would too. The head's 4 could hold everything.
    head = AutoscalingHead(tmp_path, head_cpus=4, idle_minutes=5, node_types={
        f"{name}-cpu3": NodeType(cpus=3, labels={REGION_LABEL: name}, min_nodes=1, max_nodes=1) for name in REGIONS})
    drivers: dict[str, Driver] = {}
    with watching(head, drivers, note=lambda: f"last look: {LAST_LOOK}"):
        wait_for(lambda: len(head.worker_nodes()) == len(REGIONS), 300, "the autoscaler's two labelled nodes")
        driver = drivers["the run"] = Driver(["--config", str(config), "--address", head.address], driver_env())
        placed = wait_for(lambda: _placement(cfg, head.address), 300,
                          "every region's worker, SyncActor and data reader in Ray's state API",
                          fail_if=lambda: driver.process.poll() is not None and "the driver ended")
        assert driver.process.wait(timeout=600) == 0

    assert placed == {region: {"sync": region, "stream": region, "worker": region} for region in REGIONS}, placed
    summary = json.loads((tmp_path / "labels" / "summary.json").read_text())
    assert summary["outer_steps"] == OUTER_STEPS and len(set(summary["global_digest"].values())) == 1, summary


def _placement(cfg, address: str) -> dict[str, dict[str, str | None]] | None:
    """region -> the region label of the node of its SyncActor, data reader (RegionStream) and training worker;
    None until each is up and listed once by Ray's state API (it may list a process a moment after it started)."""
    labels = {n["NodeID"]: n.get("Labels", {}).get(REGION_LABEL) for n in ray.nodes()}
    placed = {}
    for region in REGIONS:
        pid = _worker_pid(cfg, region, address)
        actors = {kind: list_actors(address=address, filters=[("name", "=", run_actor_name(kind, cfg, region))])
                  for kind in ("sync", "stream")}
        workers = [w for w in list_workers(address=address, filters=[("pid", "=", pid)]) if w.is_alive] if pid else []
        if len(workers) != 1 or any(len(found) != 1 for found in actors.values()):
            LAST_LOOK[region] = {"worker pid": pid, "workers listed": len(workers),
                                 **{f"{kind} listed": len(found) for kind, found in actors.items()}}
            return None
        placed[region] = {kind: labels.get(found[0].node_id) for kind, found in actors.items()}
        placed[region]["worker"] = labels.get(workers[0].node_id)
    return placed


def _worker_pid(cfg, region: str, address: str) -> int | None:
    """The pid of the region's (only) training worker once it has registered with the SyncActor."""
    actor = named_actor(run_actor_name("sync", cfg, region), address)
    if actor is None:
        return None
    return next(iter(ray.get(actor.worker_pids.remote()).values()), None)
