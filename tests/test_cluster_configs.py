"""The cluster examples under cluster/ and the image they name, against what the code reads. No cloud, Kubernetes,
Docker or Ray is started:

- every YAML under cluster/ parses (yaml.safe_load_all) and is one of: a Ray autoscaler config, Kubernetes
  manifests, a Prometheus config, or a ray-diloco config, which loads as `ray-diloco config --config FILE` does
  (a ConfigError fails); every region has both deployments, cluster/regions/<region>.yaml (Ray's cluster
  launcher) and cluster/kuberay/<region>.yaml (KubeRay);
- every autoscaler YAML passes Ray's own schema, its GPU node types carry REGION_LABEL, and it is one region's
  cluster (a provider has one cloud region: no YAML mixes regions' nodes);
- per region, on the launcher YAML and on the autoscaler config Ray's KubeRay code derives from the RayCluster:
  the head has no GPUs, some worker type has GPUs, 0 <= min_workers <= max_workers, every node type carries
  REGION_LABEL (imported from ray_diloco.driver) = the file's region, a GPU node holds whole workers of the
  `150m` preset (its GPUs and the CPUs they ask), and the region's needs (ray_diloco.resources.run_needs) fit
  what the autoscaler can grow to (check_fits, as the driver checks a cluster);
- the `ray job submit` command in each launcher YAML's comments and each RayJob's entrypoint parse with the
  real CLI parser as `train --local-regions <region>`, and resolve with the real CLI against the run config the
  deployment ships (the working dir's file; the ConfigMap's source file): the region's Hivemind node listens on
  0.0.0.0 at a fixed port, announces a multiaddr naming that port (the head's public IP; the Service's public
  name), so its SyncActor stays on the driver's node, and the config's worker ranges fit the cluster;
- launcher: the port is opened by the security-group rule Ray adds (its own `_update_inbound_rules` is fed the
  file's provider config);
- KubeRay: each file has a RayCluster, a Service and a RayJob (apiVersion ray.io/v1), autoscaling on, replicas
  within [minReplicas, maxReplicas]; the RayJob runs on that RayCluster, its --config lies on a head volume made
  from a file of this repository, its runtime env carries the env_vars of jobs/runtime_env.yaml, and nothing in
  it lets Ray run the driver off the head (entrypoint resources) or KubeRay delete the cluster (backoffLimit);
  the Service is a LoadBalancer that selects the head pod (KubeRay's labels) and not a worker, exposes the port
  the entrypoint passes to --port, which the head container declares beside KubeRay's own ports;
- the Dockerfile: tests/test_dockerfile.py.
"""

import dataclasses
import json
import shlex
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray
import ray.autoscaler
import yaml

# Private, but Ray is pinned to 2.60.x in pyproject.toml: Ray's translation of a RayCluster into autoscaler node
# types (what its autoscaler sees on KubeRay), and the inbound rules its AWS launcher gives the security group.
from ray.autoscaler._private.aws.config import _update_inbound_rules
from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
from ray.dashboard.consts import RAY_JOB_ALLOW_DRIVER_ON_WORKER_NODES_ENV_VAR

from ray_diloco.cli import build_parser, resolve_config
from ray_diloco.config import ConfigError, ExperimentConfig, RegionConfig
from ray_diloco.driver import REGION_LABEL
from ray_diloco.network import region_network
from ray_diloco.presets import get_preset
from ray_diloco.resources import check_fits, run_needs

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
LAUNCHER = sorted((CLUSTER / "regions").glob("*.yaml"))
KUBERAY = sorted((CLUSTER / "kuberay").glob("*.yaml"))
RAY_SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
PRESET = get_preset("150m")
PER_WORKER = PRESET.regions[0]  # what the preset asks of each worker of a region
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DOCKERFILE = ROOT / "Dockerfile"
# Stands for $HEAD_IP (`ray get-head-ip`) in the launcher YAMLs' commands: a documentation address (TEST-NET-3).
HEAD_IP = "203.0.113.7"
# The head Service's ports KubeRay 1.5 adds only where the head container lists none (getServicePorts in
# ray-operator/controllers/ray/common/service.go): the RayJob finds the dashboard there by name, workers the GCS.
KUBERAY_HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001}


def load(path: Path) -> list:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def all_yaml() -> list[Path]:
    return sorted([*CLUSTER.rglob("*.yaml"), *CLUSTER.rglob("*.yml")])


def kind_of(doc: dict) -> str:
    """What a YAML document under cluster/ is; anything else must be a ray-diloco config."""
    if "available_node_types" in doc:
        return "autoscaler"
    if "apiVersion" in doc and "kind" in doc:
        return "kubernetes"
    if "scrape_configs" in doc:
        return "prometheus"
    return "ray-diloco"


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
    needs = run_needs(PRESET, [dataclasses.replace(PER_WORKER, name=region)])
    try:
        check_fits(needs, node_totals(config, "min_workers"), node_totals(config, "max_workers"))
    except ConfigError as error:
        pytest.fail(f"{where}: {error}")


def node_totals(config: dict, count: str) -> dict[str, float]:
    """The cluster's resources with each worker type at its `min_workers` or `max_workers`, the head once."""
    sums: dict[str, float] = {}
    for name, t in config["available_node_types"].items():
        for resource, amount in t["resources"].items():
            nodes = 1 if name == config["head_node_type"] else t.get(count, 0)
            sums[resource] = sums.get(resource, 0) + amount * nodes
    return sums


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


def test_every_ray_diloco_config_loads():
    """A YAML under cluster/ that is no cluster, manifest or Prometheus config is a ray-diloco config: it loads as
    `ray-diloco config --config FILE` loads it (the preset, then the file, through ExperimentConfig)."""
    configs = [p for p in all_yaml() if all(kind_of(doc) == "ray-diloco" for doc in load(p))]
    assert configs, "cluster/ holds no ray-diloco config"
    for path in configs:
        assert len(load(path)) == 1, f"{path.relative_to(ROOT)}: a config is one YAML document"
        try:
            resolve_config(build_parser().parse_args(["config", "--config", str(path)]))
        except ConfigError as error:
            pytest.fail(f"{path.relative_to(ROOT)}: {error}")


def test_every_autoscaler_yaml_is_one_regions_cluster():
    """A launcher's provider lives in one cloud region: a cluster YAML runs one region of the run, every node type
    labelled with it (the README's one cluster per region; a single YAML cannot put nodes in two cloud regions)."""
    for path in all_yaml():
        for doc in load(path):
            if kind_of(doc) != "autoscaler":
                continue
            labels = {name: t.get("labels", {}).get(REGION_LABEL) for name, t in doc["available_node_types"].items()}
            assert len(set(labels.values())) == 1 and None not in labels.values(), \
                (f"{path.relative_to(ROOT)}: one cluster (provider region {doc['provider'].get('region')}) holds "
                 f"nodes of several regions or of none: {labels}")


def resolve_deployed(argv: list[str], config_file: Path, where: str) -> ExperimentConfig:
    """The config a deployment's `ray-diloco train` runs, resolved by the real CLI (preset, file, flags), its
    --config read from `config_file`: the repository file the deployment ships under that name."""
    args = build_parser().parse_args(argv[1:])
    args.config = str(config_file)
    try:
        cfg = resolve_config(args)
        cfg.check_elastic()
    except ConfigError as error:
        pytest.fail(f"{where}: {error}")
    return cfg


def announced(cfg: ExperimentConfig, region: str, where: str) -> tuple[str, str, int]:
    """The region's Hivemind node as the flags left it: on every interface, at a fixed port, announcing one
    multiaddr that names a port; so its SyncActor stays on the driver's node. Returns (protocol, host, port)."""
    network = region_network(cfg, region)
    assert network.host == "0.0.0.0", f"{where}: Hivemind listens on {network.host}, not on the pod's or node's " \
                                      "public interface (--listen-host 0.0.0.0)"
    assert network.port, f"{where}: no fixed --port: no firewall rule or Service can name the port"
    assert len(network.announce) == 1, f"{where}: announces {network.announce}, not one address (--announce)"
    assert network.pinned, f"{where}: the SyncActor may land off the driver's node the address names"
    # ray_diloco.network checked it is a multiaddr when the config loaded: /<ip4|dns4|…>/<host>/tcp/<port>.
    _, protocol, host, transport, port = network.announce[0].split("/")[:5]
    assert transport == "tcp", f"{where}: {network.announce[0]} is not a TCP address"
    return protocol, host, int(port)


def check_run_fits(cfg: ExperimentConfig, config: dict, where: str) -> None:
    """The deployed config's region: its minimum within what the cluster has or can grow to, its maximum (a worker
    range's upper end) within what the autoscaler can reach."""
    groups = cfg.local_regions()
    try:
        check_fits(run_needs(cfg, groups), node_totals(config, "min_workers"), node_totals(config, "max_workers"))
        check_fits(run_needs(cfg, groups, at_most=True), node_totals(config, "max_workers"), None)
    except ConfigError as error:
        pytest.fail(f"{where}: {error}")


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.stem)
def test_launcher_hivemind_address(path):
    """The `ray job submit` command listens on the head, announces the head's public IP at the port the security
    group opens, and runs the region of the repository's run config (which the working dir ships)."""
    region, text = path.stem, path.read_text()
    config, = load(path)
    comments = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    assert f"HEAD_IP=$(ray get-head-ip {path.relative_to(ROOT)})" in comments, \
        f"{path.name}: no `HEAD_IP=$(ray get-head-ip {path.relative_to(ROOT)})` for the address --announce names"
    commands = submit_commands(text)
    assert commands, f"{path.name}: no `ray job submit` command in its comments"
    for command in commands:
        argv = [arg.replace("$HEAD_IP", HEAD_IP) for arg in command[command.index("--") + 1:]]
        args = parse_train(argv, region, path.name)
        config_file = ROOT / args.config  # --working-dir . ships the repository; the job starts in it
        assert config_file.is_file(), f"{path.name}: --config {args.config} is no file of the repository"
        cfg = resolve_deployed(argv, config_file, path.name)
        protocol, host, port = announced(cfg, region, path.name)
        assert (protocol, host) == ("ip4", HEAD_IP), f"{path.name}: --announce names /{protocol}/{host}, not $HEAD_IP"
        listen = region_network(cfg, region).port
        assert port == listen, f"{path.name}: announces port {port}, listens on {listen} (no NAT on the head)"
        check_run_fits(cfg, config, path.name)

        # The inbound rules Ray's AWS launcher gives the security group it creates, from this file.
        sent: list[dict] = []

        class NewGroup:
            ip_permissions: list = []

            def authorize_ingress(self, IpPermissions):  # noqa: N803 (boto3's name)
                sent.extend(IpPermissions)

        _update_inbound_rules(NewGroup(), {"sg-of-the-cluster"}, config)
        opening = [rule for rule in sent if rule.get("IpProtocol") == "tcp" and rule.get("IpRanges")
                   and rule["FromPort"] <= listen <= rule["ToPort"]]
        assert opening, f"{path.name}: no inbound rule opens TCP {listen} (provider.security_group.IpPermissions)"


def pod_labels(cluster: dict, node_type: str, group: str, template: dict) -> dict[str, str]:
    """The labels KubeRay 1.5 gives a Ray pod (labelPod, ray-operator/controllers/ray/common/pod.go): its own,
    overridden by the template's except ray.io/cluster, ray.io/node-type and ray.io/group."""
    name = cluster["metadata"]["name"]
    fixed = {"ray.io/cluster": name, "ray.io/node-type": node_type, "ray.io/group": group}
    own = {"ray.io/is-ray-node": "yes", "ray.io/identifier": f"{name}-{node_type}",
           "app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": "kuberay-operator"}
    return {**own, **template.get("metadata", {}).get("labels", {}), **fixed}


def configmap_source(path: Path, cluster: dict, config_arg: str) -> Path:
    """The repository file behind the entrypoint's --config: the head volume mounted at its directory is a
    ConfigMap, made from a file by the `kubectl create configmap NAME --from-file=KEY=FILE` in the comments."""
    pod = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0].get("volumeMounts", [])
                 if m["mountPath"].rstrip("/") == str(Path(config_arg).parent))
    volume = next(v for v in pod.get("volumes", []) if v["name"] == mount["name"])
    assert "configMap" in volume, f"{path.name}: --config {config_arg} lies on no ConfigMap"
    made = [shlex.split(line.lstrip("#"), comments=True) for line in path.read_text().splitlines()
            if line.lstrip("# ").startswith("kubectl create configmap")]
    assert made, f"{path.name}: no `kubectl create configmap` command in its comments"
    for words in made:
        if words[3] == volume["configMap"]["name"]:
            sources = [w.split("=", 1)[1] for w in words if w.startswith("--from-file=")]
            key, _, file = sources[0].partition("=") if sources else ("", "", "")
            assert key == Path(config_arg).name, f"{path.name}: the ConfigMap holds {key!r}, --config reads " \
                                                 f"{Path(config_arg).name!r}"
            assert (ROOT / file).is_file(), f"{path.name}: the ConfigMap is made from {file!r}, no file of the " \
                                            "repository (--from-file=KEY=FILE)"
            return ROOT / file
    pytest.fail(f"{path.name}: no `kubectl create configmap {volume['configMap']['name']}` in its comments")


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.stem)
def test_kuberay_hivemind_service(path):
    """A LoadBalancer Service sends the region's Hivemind port to the head pod, which declares it; the RayJob's
    entrypoint listens there and announces the Service's public name; the driver, and so the SyncActor, stays on
    the head."""
    region, where = path.stem, f"{path.name}"
    by_kind: dict[str, list[dict]] = {}
    for doc in load(path):
        by_kind.setdefault(doc["kind"], []).append(doc)
    assert len(by_kind.get("Service", [])) == 1, f"{path.name}: no one Service for the region's Hivemind port"
    cluster, job, service = by_kind["RayCluster"][0], by_kind["RayJob"][0], by_kind["Service"][0]
    head_template = cluster["spec"]["headGroupSpec"]["template"]
    head = head_template["spec"]["containers"][0]

    # The Service: a public load balancer in front of the head pod, and of no worker pod.
    assert service["spec"].get("type") == "LoadBalancer", f"{where}: the Service is no LoadBalancer (no public address)"
    selector = service["spec"].get("selector") or {}
    head_labels = pod_labels(cluster, "head", "headgroup", head_template)
    assert selector and selector.items() <= head_labels.items(), \
        f"{where}: the Service's selector {selector} does not select the head pod (labels {head_labels})"
    for group in cluster["spec"]["workerGroupSpecs"]:
        assert not selector.items() <= pod_labels(cluster, "worker", group["groupName"], group["template"]).items(), \
            f"{where}: the Service's selector {selector} also selects the {group['groupName']} worker pods"
    ports = service["spec"].get("ports", [])
    assert len(ports) == 1 and ports[0].get("protocol", "TCP") == "TCP", f"{where}: the Service has not one TCP port"
    target = ports[0].get("targetPort", ports[0]["port"])
    declared = head.get("ports", [])
    container_port = next((p["containerPort"] for p in declared if target in (p.get("name"), p["containerPort"])),
                          None)
    assert container_port is not None, f"{where}: the Service's targetPort {target!r} is no port the head declares"
    by_name = {p.get("name"): p["containerPort"] for p in declared}
    dropped = {name: port for name, port in KUBERAY_HEAD_PORTS.items() if by_name.get(name) != port}
    assert not dropped, f"{where}: the head lists ports but not KubeRay's {dropped}, which listing ports drops"

    # The entrypoint, resolved with the run config the ConfigMap is made from.
    argv = shlex.split(job["spec"]["entrypoint"])
    args = parse_train(argv, region, f"{where} entrypoint")
    cfg = resolve_deployed(argv, configmap_source(path, cluster, args.config), f"{where} entrypoint")
    protocol, host, port = announced(cfg, region, f"{where} entrypoint")
    listen = region_network(cfg, region).port
    assert listen == container_port, f"{where}: --port {listen}, but the Service sends to the head's {container_port}"
    assert port == ports[0]["port"], f"{where}: --announce names port {port}, the Service exposes {ports[0]['port']}"
    public_name = (service["metadata"].get("annotations") or {}).get("external-dns.alpha.kubernetes.io/hostname")
    assert protocol.startswith("dns") and host == public_name, \
        f"{where}: --announce names /{protocol}/{host}, not the Service's public name {public_name!r}"
    metadata = {"namespace": "default", **cluster["metadata"]}
    check_run_fits(cfg, _derive_autoscaling_config_from_ray_cr({**cluster, "metadata": metadata}), where)

    # Nothing moves the driver off the head (Ray 2.60's job manager runs it there unless the job asks for resources
    # or the head's env allows workers), lets KubeRay delete the cluster, or reuses a Ray submission id.
    spec = job["spec"]
    asks = [key for key in ("entrypointNumCpus", "entrypointNumGpus", "entrypointResources") if spec.get(key)]
    assert not asks, f"{where}: the RayJob sets {asks}: Ray may then run the driver (and SyncActor) off the head"
    env = {e["name"]: e.get("value") for e in head.get("env", [])}
    assert env.get(RAY_JOB_ALLOW_DRIVER_ON_WORKER_NODES_ENV_VAR) != "1", f"{where}: the head lets drivers off it"
    assert not spec.get("backoffLimit"), f"{where}: backoffLimit: KubeRay 1.5 retries by deleting the RayCluster " \
                                         "a clusterSelector names"
    assert "jobId" not in spec, f"{where}: a fixed jobId: the RayJob applied again reuses a Ray submission id"
    assert spec.get("submissionMode", "K8sJobMode") in ("K8sJobMode", "HTTPMode"), \
        f"{where}: submissionMode {spec['submissionMode']}: KubeRay submits no job (Interactive) or refuses a " \
        "clusterSelector (Sidecar)"
