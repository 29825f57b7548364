"""The cluster examples under cluster/ against what the code reads. No cloud, Kubernetes or Ray is started:

- every YAML under cluster/ parses (yaml.safe_load_all), and every region has both deployments,
  cluster/regions/<region>.yaml (Ray's cluster launcher) and cluster/kuberay/<region>.yaml (KubeRay);
- every autoscaler YAML passes Ray's own schema, and its GPU node types carry REGION_LABEL;
- per region, on the launcher YAML and on the autoscaler config Ray's KubeRay code derives from the RayCluster:
  the head has no GPUs, some worker type has GPUs, 0 <= min_workers <= max_workers, every node type carries
  REGION_LABEL (imported from ray_diloco.driver) = the file's region, a GPU node holds whole workers of the
  `150m` preset (its GPUs and the CPUs they ask), and the region's needs (ray_diloco.resources.run_needs) fit
  what the autoscaler can grow to (check_fits, as the driver checks a cluster);
- the `ray job submit` command in each launcher YAML's comments and each RayJob's entrypoint parse with the
  real CLI parser as `train --local-regions <region>`;
- each KubeRay file has a RayCluster and a RayJob (apiVersion ray.io/v1), autoscaling on, replicas within
  [minReplicas, maxReplicas]; the RayJob runs on that RayCluster, its --config lies on a head volume, and its
  runtime env carries the env_vars of jobs/runtime_env.yaml.
"""

import dataclasses
import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml

# Ray's translation of a RayCluster into autoscaler node types (what its autoscaler sees on KubeRay).
# Private, but Ray is pinned to 2.60.x in pyproject.toml.
from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

from ray_diloco.cli import build_parser
from ray_diloco.config import ConfigError, RegionConfig
from ray_diloco.driver import REGION_LABEL
from ray_diloco.presets import get_preset
from ray_diloco.resources import check_fits, run_needs

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
LAUNCHER = sorted((CLUSTER / "regions").glob("*.yaml"))
KUBERAY = sorted((CLUSTER / "kuberay").glob("*.yaml"))
RAY_SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
PRESET = get_preset("150m")
PER_WORKER = PRESET.regions[0]  # what the preset asks of each worker of a region


def load(path: Path) -> list:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def all_yaml() -> list[Path]:
    return sorted([*CLUSTER.rglob("*.yaml"), *CLUSTER.rglob("*.yml")])


def test_every_yaml_parses_and_every_region_has_both_deployments():
    for path in all_yaml():
        assert load(path), f"{path.relative_to(ROOT)} has no document"
    regions = {p.stem for p in LAUNCHER}
    assert len(regions) >= 3, f"cluster/regions/ should show a 3-region deployment, has {sorted(regions)}"
    assert regions == {p.stem for p in KUBERAY}, "cluster/regions/ and cluster/kuberay/ name different regions"
    for name in regions:
        RegionConfig(name=name)  # the file name is a region name the config accepts


def test_every_autoscaler_yaml_passes_rays_schema():
    configs = {p: doc for p in all_yaml() for doc in load(p) if "available_node_types" in doc}
    assert set(LAUNCHER) <= set(configs)
    for path, config in configs.items():
        jsonschema.validate(config, RAY_SCHEMA)
        for name, node_type in config["available_node_types"].items():
            if node_type["resources"].get("GPU", 0):  # training workers land there: the driver pins them by label
                assert REGION_LABEL in node_type.get("labels", {}), f"{path.name}: {name} lacks {REGION_LABEL}"


def check_region_cluster(config: dict, region: str, where: str) -> None:
    """The checks shared by a launcher YAML and the autoscaler config derived from a RayCluster."""
    types = config["available_node_types"]
    head_name = config["head_node_type"]
    assert types[head_name]["resources"].get("GPU", 0) == 0, f"{where}: the head has GPUs"
    workers = {name: t for name, t in types.items() if name != head_name}
    gpu_types = {name: t for name, t in workers.items() if t["resources"].get("GPU", 0) > 0}
    assert gpu_types, f"{where}: no worker node type has GPUs"
    for name, t in workers.items():
        assert 0 <= t.get("min_workers", 0) <= t["max_workers"], f"{where}: {name} min_workers > max_workers"
        assert t["max_workers"] >= 1, f"{where}: {name} can never start"
    for name, t in types.items():
        label = t.get("labels", {}).get(REGION_LABEL)
        assert label == region, f"{where}: {name} has {REGION_LABEL}={label!r}, not {region!r}"

    # A Ray Train worker's bundle must fit on one node, and the CPUs must not leave a node's GPUs idle.
    assert PER_WORKER.gpus_per_worker > 0, "the 150m preset trains on GPUs"
    for name, t in gpu_types.items():
        fits = t["resources"]["GPU"] // PER_WORKER.gpus_per_worker
        assert fits >= 1, f"{where}: {name} has fewer GPUs than one worker asks ({PER_WORKER.gpus_per_worker:g})"
        cpus, need = t["resources"].get("CPU", 0), fits * PER_WORKER.cpus_per_worker
        assert cpus >= need, f"{where}: {name} has {cpus} CPUs, its {fits:g} workers ask {need:g}"

    # The region's whole run (its workers, SyncActor, evaluator, data reads) within the autoscaler's maximum.
    def total(count) -> dict[str, float]:
        sums: dict[str, float] = {}
        for name, t in types.items():
            for resource, amount in t["resources"].items():
                sums[resource] = sums.get(resource, 0) + amount * (1 if name == head_name else count(t))
        return sums

    needs = run_needs(PRESET, [dataclasses.replace(PER_WORKER, name=region)])
    try:
        check_fits(needs, total(lambda t: t.get("min_workers", 0)), total(lambda t: t["max_workers"]))
    except ConfigError as error:
        pytest.fail(f"{where}: {error}")


def submit_commands(text: str) -> list[list[str]]:
    """The `ray job submit` commands in a file's comments, continuation lines joined."""
    commands, current = [], ""
    for line in text.splitlines():
        if not line.startswith("#"):
            continue
        line = line.lstrip("#").strip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        if (current + line).startswith("ray job submit"):
            commands.append(shlex.split(current + line))
        current = ""
    return commands


def parse_train(argv: list[str], region: str, where: str):
    assert argv[:2] == ["ray-diloco", "train"], f"{where}: runs {argv[:2]}, not ray-diloco train"
    args = build_parser().parse_args(argv[1:])
    assert args.local_regions == region, f"{where}: --local-regions {args.local_regions!r}, not {region!r}"
    assert args.config, f"{where}: no --config (every cluster runs the one config of the run)"
    return args


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.stem)
def test_launcher_yaml(path):
    config, = load(path)
    # Resources a node type does not name are read from its instance type: name the head's GPUs (none).
    assert config["available_node_types"][config["head_node_type"]]["resources"].get("GPU") == 0, \
        f"{path.name}: the head must say GPU: 0"
    check_region_cluster(config, path.stem, path.name)

    commands = submit_commands(path.read_text())
    assert commands, f"{path.name}: no `ray job submit` command in its comments"
    for command in commands:
        separator = command.index("--")
        flags = command[:separator]
        runtime_env = flags[flags.index("--runtime-env") + 1] if "--runtime-env" in flags else None
        assert runtime_env and (ROOT / runtime_env).is_file(), f"{path.name}: --runtime-env {runtime_env!r}"
        parse_train(command[separator + 1:], path.stem, path.name)


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.stem)
def test_kuberay_manifests(path):
    region = path.stem
    docs = load(path)
    kinds = {doc["kind"]: doc for doc in docs}
    assert {"RayCluster", "RayJob"} <= kinds.keys(), f"{path.name}: kinds {sorted(kinds)}"
    for doc in docs:
        if doc["kind"] in ("RayCluster", "RayJob"):
            assert doc["apiVersion"] == "ray.io/v1", f"{path.name}: {doc['kind']} is {doc['apiVersion']}"
    cluster, job = kinds["RayCluster"], kinds["RayJob"]

    spec = cluster["spec"]
    assert spec.get("enableInTreeAutoscaling") is True, f"{path.name}: without autoscaling the replica range is unused"
    for group in spec["workerGroupSpecs"]:
        name, low, high = group["groupName"], group["minReplicas"], group["maxReplicas"]
        assert 0 <= low <= high, f"{path.name}: {name} has minReplicas {low} > maxReplicas {high}"
        assert low <= group.get("replicas", low) <= high, f"{path.name}: {name} replicas outside [min, max]"
    metadata = {"namespace": "default", **cluster["metadata"]}
    check_region_cluster(_derive_autoscaling_config_from_ray_cr({**cluster, "metadata": metadata}), region,
                         f"{path.name} (as Ray's autoscaler reads it)")

    assert job["spec"].get("clusterSelector") == {"ray.io/cluster": cluster["metadata"]["name"]}, \
        f"{path.name}: the RayJob does not run on the region's RayCluster"
    args = parse_train(shlex.split(job["spec"]["entrypoint"]), region, f"{path.name} entrypoint")
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    mounts = {m["mountPath"].rstrip("/") for m in head.get("volumeMounts", [])}
    assert str(Path(args.config).parent) in mounts, f"{path.name}: --config {args.config} is on no head volume"

    env = yaml.safe_load(job["spec"].get("runtimeEnvYAML", "")) or {}
    expected = yaml.safe_load((ROOT / "jobs" / "runtime_env.yaml").read_text())["env_vars"]
    missing = {k: v for k, v in expected.items() if env.get("env_vars", {}).get(k) != v}
    assert not missing, f"{path.name}: runtimeEnvYAML lacks jobs/runtime_env.yaml's {missing}"
