"""Two regions in one Ray cluster whose worker nodes carry region labels (`ray.io/availability-region`, as
`cluster/` sets them): each region's training workers and its SyncActor run on the nodes labelled with its name,
and nowhere else, though the unlabelled head has room for all of them and the other region's node for some.

The nodes are started by Ray's autoscaler (tests/autoscaling_head.py): one node type per region, at least and at
most one node each, labelled through the node type's `labels`, as a cluster YAML of the README's would. The driver
finds the labels on the cluster's nodes and gives each region's Ray Train group and actors the region's label
selector (`ray_diloco.driver.region_placement`).
"""

import dataclasses

import pytest
import ray
from ray.util.state import list_actors, list_workers

from autoscaling_head import AutoscalingHead, NodeType
from conftest import RunInThread, wait_for
from ray_diloco.config import RegionConfig
from ray_diloco.driver import REGION_LABEL, run_actor_name, run_training
from ray_diloco.presets import tiny_cpu

REGIONS = ("us", "eu")


def labelled_run(tmp_path):
    cfg = tiny_cpu()
    return dataclasses.replace(
        cfg, regions=[RegionConfig(name=name, workers=1) for name in REGIONS],
        inner=dataclasses.replace(cfg.inner, warmup_steps=2),
        outer=dataclasses.replace(cfg.outer, inner_steps=4, matchmaking_seconds=5.0),
        run=dataclasses.replace(cfg.run, name="labels", outer_steps=2, eval_every=0, output_dir=str(tmp_path)))


@pytest.mark.timeout(900)
def test_each_region_runs_on_the_nodes_labelled_with_its_name(tmp_path):
    cfg = labelled_run(tmp_path)
    # 3 CPUs a node: a region's worker (1), SyncActor (0.5) and data tasks fit on its own node, and the worker or
    # SyncActor of the other region would too. The head (4) could hold everything.
    head = AutoscalingHead(tmp_path, head_cpus=4, idle_minutes=5, node_types={
        f"{name}-cpu3": NodeType(cpus=3, labels={REGION_LABEL: name}, min_nodes=1, max_nodes=1) for name in REGIONS})
    placed: dict[str, dict[str, str | None]] = {}  # region -> {"sync": label, "worker": label}
    try:
        ray.init(address=head.address)
        wait_for(lambda: len(head.worker_nodes()) == len(REGIONS), 300, "the autoscaler's two labelled nodes")
        ray.shutdown()
        run = RunInThread(lambda: run_training(cfg, address=head.address))
        # Not ray.get_actor before the driver has connected: it would start a Ray of its own.
        wait_for(lambda: ray.is_initialized() and all(_worker_pid(cfg, r) for r in REGIONS), 300,
                 "every region's worker")
        labels = {n["NodeID"]: n.get("Labels", {}).get(REGION_LABEL) for n in ray.nodes()}
        for region in REGIONS:
            (sync,) = list_actors(address=head.address,
                                  filters=[("name", "=", run_actor_name("sync", cfg, region)), ("state", "=", "ALIVE")])
            (worker,) = list_workers(address=head.address, filters=[("pid", "=", _worker_pid(cfg, region))])
            placed[region] = {"sync": labels.get(sync.node_id), "worker": labels.get(worker.node_id)}
        summary = run.join(600)
    finally:
        ray.shutdown()
        head.stop()

    assert placed == {region: {"sync": region, "worker": region} for region in REGIONS}, placed
    assert summary["outer_steps"] == 2 and len(set(summary["global_digest"].values())) == 1, summary


def _worker_pid(cfg, region: str) -> int | None:
    """The pid of the region's (only) training worker once it has registered with the SyncActor."""
    try:
        actor = ray.get_actor(run_actor_name("sync", cfg, region))
    except ValueError:
        return None
    return next(iter(ray.get(actor.worker_pids.remote()).values()), None)
