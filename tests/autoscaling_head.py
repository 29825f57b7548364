"""A Ray head with Ray's own autoscaler, on this machine: `ray start --head --block --autoscaling-config=…` with the
fake multi-node node provider, extended with what a cloud does at a preemption (tests/preemptible_provider.py;
the provider is the one `ray.cluster_utils.AutoscalingCluster` drives, but that class runs
`ray stop --force`, which would stop every Ray on the machine, so the head is started here the same way, in a
process group of its own, and stopped by it). The autoscaler starts worker nodes of the given types (each
labelled with a region) up to their minimums, and more when tasks and actors ask for more than the cluster has
(Ray Train's elastic policy asks for its group's largest size), and terminates the nodes that stay idle, as on a
cloud. A preemption is `drain` (the cloud's notice: reason PREEMPTION and a deadline), then `kill_node` at the
deadline; `withhold_capacity` makes launches wait, as a zone out of spot instances does.

The head takes the authentication mode of the test process, which is a client of it (it watches the run there;
the drivers, processes of their own, inherit its environment): Ray turns token mode on for the whole process at its
first local `ray.init` (it sets `RAY_AUTH_MODE=token` in `os.environ`), and leaves it off when the process has
only connected to clusters. A head and its clients must agree: with a head without tokens and a process in token
mode, a driver in the process refused the head's calls ("Missing authorization header") and the region's SyncActor
died at once; the other way round, the process cannot connect. In token mode the head uses the machine's default
token (`~/.ray/auth_token`, the one the process reads), and the autoscaler's nodes inherit the mode and read the
same file."""

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import ray
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
from conftest import RAY, descendants, head_ports, kill
from leftovers import carries
from ray_diloco.driver import REGION_LABEL


class NodeType(NamedTuple):
    """Worker nodes the autoscaler may start: their CPUs and labels, and how many at least and at most."""
    cpus: int
    labels: dict[str, str]
    min_nodes: int
    max_nodes: int


def autoscaling_config(port: int, head_cpus: int, node_types: dict[str, NodeType], idle_minutes: float,
                       no_capacity_file: Path) -> dict:
    """The cluster config of Ray's fake multi-node provider: the head, and worker nodes of `node_types`."""
    workers = {name: {"resources": {"CPU": t.cpus}, "labels": t.labels, "node_config": {},
                      "min_workers": t.min_nodes, "max_workers": t.max_nodes} for name, t in node_types.items()}
    return {
        "cluster_name": "ray-diloco-test", "max_workers": sum(t.max_nodes for t in node_types.values()),
        "provider": {"type": "external", "module": "preemptible_provider.PreemptibleFakeProvider",
                      "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": f"127.0.0.1:{port}",
                     "no_capacity_file": str(no_capacity_file)},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0}, **workers},
        "head_node_type": "ray.head.default", "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": idle_minutes,
        "docker": {}, "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": []}


class AutoscalingHead:
    def __init__(self, tmp: Path, head_cpus: int, node_types: dict[str, NodeType], idle_minutes: float,
                 env: dict[str, str] | None = None):
        self.port, dashboard_port, component_ports = head_ports()
        self.address = f"127.0.0.1:{self.port}"
        self.no_capacity_file = tmp / f"no-capacity-{self.port}"
        config = tmp / "autoscaling.json"
        config.write_text(json.dumps(autoscaling_config(self.port, head_cpus, node_types, idle_minutes,
                                                        self.no_capacity_file)))
        # `env`: more variables for every process of the cluster (the autoscaler's nodes inherit the head's)
        self.env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **(env or {})}
        token_mode = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
        if token_mode:
            subprocess.run([RAY, "get-auth-token", "--generate"], env=self.env, capture_output=True, check=True)
        self.env.update(RAY_AUTH_MODE="token" if token_mode else "disabled", RAY_FAKE_CLUSTER="1",
                        AUTOSCALER_UPDATE_INTERVAL_S="1",  # the autoscaler looks every second, not every 5
                        # `stop`'s SIGTERM tears the head down at once; by default it first drains the node for up
                        # to 30 s (for Ray Serve's proxies), which only slows the test's end.
                        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
                        # The autoscaler (the head's monitor process) imports tests/preemptible_provider.py; Ray
                        # passes the variable on to every process of the cluster, where it does nothing else.
                        PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                 os.environ.get("PYTHONPATH")])))
        self.log_path = tmp / f"autoscaling-head-{self.port}.log"
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [RAY, "start", "--head", "--block", f"--autoscaling-config={config}", f"--num-cpus={head_cpus}",
             f"--port={self.port}", f"--dashboard-port={dashboard_port}", "--disable-usage-stats", *component_ports],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        try:
            deadline = time.monotonic() + 180
            while not self._answers():
                assert self.process.poll() is None and time.monotonic() < deadline, \
                    self.log_path.read_text()[-3000:]
                time.sleep(2)
        except BaseException:
            self.stop()  # a head that did not come up leaves nothing behind
            raise

    def _answers(self) -> bool:
        """`ray status` succeeds: the head is up. A call that hangs (the GCS still starting) counts as not yet."""
        try:
            return subprocess.run([RAY, "status", f"--address={self.address}"], env=self.env, capture_output=True,
                                  timeout=60).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def worker_nodes(self) -> list[dict]:
        """The alive nodes the autoscaler started (this process must be connected to the head)."""
        return [n for n in ray.nodes() if n["Alive"] and n["NodeID"] != FAKE_HEAD_NODE_ID]

    def drain(self, node_id: str, deadline_seconds: int) -> None:
        """A preemption notice for `node_id`: drained with reason PREEMPTION, to be gone in `deadline_seconds`."""
        subprocess.run([RAY, "drain-node", f"--address={self.address}", f"--node-id={node_id}",
                        "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=spot instance preempted (test)",
                        f"--deadline-remaining-seconds={deadline_seconds}"], env=self.env, check=True,
                       capture_output=True)

    def withhold_capacity(self, withheld: bool) -> None:
        """While withheld, the cloud has no instance to give: the autoscaler's launches wait."""
        if withheld:
            self.no_capacity_file.touch()
        else:
            self.no_capacity_file.unlink(missing_ok=True)

    def kill_node(self, node_id: str) -> None:
        """What a cloud does at a preemption's deadline: the node's processes end at once (SIGKILL), and the node
        provider no longer lists it (tests/preemptible_provider.py), so the autoscaler may start another. A drained
        node's raylet ends by itself once nothing runs there (seen under load, before this was called): then there
        is nothing left to kill, and Ray must list the node dead (this process must be connected to the head)."""
        processes = node_processes(node_id, self.process.pid)
        if processes:
            kill(processes)
            return
        deadline = time.monotonic() + 60  # Ray lists an exited raylet's node dead within moments
        while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            assert time.monotonic() < deadline, f"no process of live node {node_id} under this head"
            time.sleep(1)

    def stop(self) -> None:
        """SIGTERM to `ray start` (it stops its processes in order), then SIGKILL to its process group (the
        autoscaler's nodes are in it: its monitor starts them) and to any process left of its session (Ray's
        workers leave the group)."""
        session = re.search(r"session_\d{4}-\d\d-\d\d_[\d_-]+", self.log_path.read_text())
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except OSError:
            pass
        self.process.wait()
        self.log.close()
        if session:
            kill(session_processes(session.group(0)))
        # As `ray stop` does: a later `ray.init()` without an address (Ray's auto-connect, in any process) must not
        # attach to this stopped head; Ray ends a process whose raylet it cannot reach, with no report.
        current = Path("/tmp/ray/ray_current_cluster")
        try:
            if current.read_text().strip().endswith(f":{self.port}"):
                current.unlink()
        except OSError:
            pass  # none, or another cluster's


def session_processes(session: str) -> list[int]:
    """Processes whose command line names the Ray session directory `session`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if session in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def node_processes(node_id: str, head_pid: int) -> list[int]:
    """The processes of the fake provider's node `node_id` under this head: the provider starts them with the
    node's id in their environment, which the raylet's workers inherit. Node ids repeat from one head to the next,
    so only this head's descendants count."""
    marker = f"RAY_OVERRIDE_NODE_ID_FOR_TESTING={node_id}".encode()
    return [pid for pid in descendants(head_pid) if carries(pid, marker)]


def one_region_head(tmp: Path, region: str, idle_minutes: float, env: dict[str, str] | None = None) -> AutoscalingHead:
    """A region's cluster: a head of 1 CPU (the SyncActor and data tasks; no room for a worker) whose autoscaler
    starts nodes of 2 CPUs labelled with `region`, one at least and two at most; `env` reaches all its processes."""
    return AutoscalingHead(tmp, head_cpus=1, idle_minutes=idle_minutes, env=env, node_types={
        f"{region}-cpu2": NodeType(cpus=2, labels={REGION_LABEL: region}, min_nodes=1, max_nodes=2)})

@contextlib.contextmanager
def watching(head: AutoscalingHead, drivers: dict, note=lambda: ""):
    """The body of a test that runs drivers (`drivers`: name -> conftest.Driver, filled as the body starts them) on
    `head`, with this process connected to it: it only watches, every driver is a process of its own. A failure (a
    wait, a dead actor, pytest's timeout) gets `note()` and what each driver printed last, which say why; in any
    case the drivers are ended, Ray is shut down and the head stopped."""
    try:
        ray.init(address=head.address)
        yield
    except BaseException as failure:
        failure.add_note(note() + "".join(f"\n--- {name}'s driver (end) ---\n{driver.output()[-3000:]}"
                                          for name, driver in drivers.items()))
        raise
    finally:
        for driver in drivers.values():
            driver.end()
        ray.shutdown()
        head.stop()
