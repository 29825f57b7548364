"""`ray job submit` as the README runs it, on real local heads started with `ray start --head`:

- a 2-region job on a head with 2 CPUs (it needs 3.75, the evaluator's 0.5 included) fails within seconds with the resource message (it
  used to hang forever waiting for workers that could never be placed);
- `ray-diloco train` with a `ray start` cluster running starts a private Ray; `--address auto` attaches;
- the README's job commands (`ray start --head --num-cpus 4`, the 2-region job): `ray job stop` ends the run at
  an outer step with a checkpoint, and the job submitted again under the same run name after an edit to the
  working directory continues from it (outputs go to a fixed storage path, not Ray's per-upload copy of the
  working directory) to the model of a run that was never stopped.

Each head is started with `--block` in its own process group and stopped by that group's id (never `ray stop`,
which would stop every Ray on the machine).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from conftest import RAY, free_ports, head_ports

ROOT = Path(__file__).resolve().parents[1]


class Head:
    """`ray start --head --block` on free ports; `env` points `ray job` and `ray.init` at it."""

    def __init__(self, num_cpus: int, tmp: Path, token: Path | None = None):
        self.port, self.dashboard_port, component_ports = head_ports()
        # A home of its own, as on a fresh machine: the README's first command makes the token there, the
        # head, its jobs and the clients read it, and the default results directory lands under it.
        self.home = tmp / f"home-{self.port}"
        self.home.mkdir()
        self.env = {**os.environ, "HOME": str(self.home), "RAY_ADDRESS": f"127.0.0.1:{self.port}",
                    "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{self.dashboard_port}"}
        self.token = self.home / ".ray" / "auth_token"
        if token is None:
            subprocess.run([RAY, "get-auth-token", "--generate"], env=self.env, capture_output=True, check=True)
        else:  # several heads on one machine: a job driver may read the newest session's token (Ray 2.60)
            self.token.parent.mkdir()
            shutil.copy2(token, self.token)
        self.env["RAY_AUTH_MODE"] = "token"
        # No drain at the end (a Serve upgrade's concern): Ray Train's and Ray Data's detached actors never let the
        # node drain, and the head waited out the whole 30 s timeout at each stop.
        head_env = {**self.env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
        self.log = open(tmp / f"head-{self.port}.log", "w")
        self.process = subprocess.Popen(
            [RAY, "start", "--head", "--block", f"--num-cpus={num_cpus}", f"--port={self.port}",
             f"--dashboard-port={self.dashboard_port}", "--disable-usage-stats",
             # Ports of their own: with the defaults, a second Ray on the machine (another test's, a user's)
             # takes the agent's port and this head never accepts a job.
             *component_ports],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=head_env)
        deadline = time.monotonic() + 90
        while subprocess.run([RAY, "job", "list"], env=self.env, capture_output=True).returncode != 0:
            assert self.process.poll() is None and time.monotonic() < deadline, "the head did not start"
            time.sleep(2)

    def submit(self, working_dir: Path, *args: str, timeout: float = 600,
               cli_args_first: bool = False) -> subprocess.CompletedProcess:
        """`ray job submit` as the README writes it; with cli_args_first, args[0] goes to `ray job submit`."""
        submit_args, args = (args[:1], args[1:]) if cli_args_first else ((), args)
        command = [RAY, "job", "submit", *submit_args, "--working-dir", ".", "--runtime-env",
                   "jobs/runtime_env.yaml", "--", "python", "jobs/train.py", *args]
        for _ in range(30):  # a fresh head answers `ray job list` before its job agent takes jobs
            done = subprocess.run(command, cwd=working_dir, env=self.env, capture_output=True, text=True,
                                  timeout=timeout)
            output = done.stdout + done.stderr
            # a fresh head's dashboard may also drop the first connections on a loaded machine
            if not any(text in output for text in ("No available agent to submit job", "Connection aborted",
                                                    "Connection refused")):
                return done
            time.sleep(2)
        return done

    def stop(self):
        self.begin_stop()
        self.finish_stop()

    def begin_stop(self):
        """Several heads stop together: each drains for seconds, and one after the other cost their sum."""
        # SIGTERM to `ray start` alone: it stops its processes in order (seconds). To the whole group, the GCS
        # died first and the head waited for it until a timeout (33-60 s per head).
        self.process.send_signal(signal.SIGTERM)

    def finish_stop(self):
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:  # anything of the head's group still there
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.log.close()


def repository_copy(tmp: Path) -> Path:
    """The tracked files of this repository, as a user's clone would have them."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    copy = tmp / "clone"
    for name in files.splitlines():
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    return copy


@pytest.fixture(scope="module")
def small_head(tmp_path_factory):
    head = Head(2, tmp_path_factory.mktemp("head2"))
    yield head
    head.stop()


def test_the_ports_a_head_is_given_are_distinct():
    """Probed one after the other, ports repeat (in CI a head got one for two components and did not start); 500 at
    once, held until all are chosen, never do (one after the other, each of 30 draws of 500 here repeated one)."""
    ports = free_ports(500)
    assert len(set(ports)) == 500 and all(port > 0 for port in ports)
    gcs, dashboard, flags = head_ports()
    assert len({gcs, dashboard, *(int(flag.split("=")[1]) for flag in flags)}) == 2 + len(flags) == 7


def test_a_job_that_cannot_fit_fails_within_seconds_with_the_resource_message(small_head, tmp_path):
    started = time.monotonic()
    done = small_head.submit(ROOT, "--regions", "2", "--output-dir", str(tmp_path), timeout=180)
    seconds = time.monotonic() - started
    assert done.returncode != 0, done.stdout[-2000:]
    assert "the run needs 3.75 CPU" in done.stdout and "cluster has 2" in done.stdout, done.stdout[-3000:]
    assert "Traceback" not in done.stdout, done.stdout[-3000:]
    assert seconds < 90, seconds  # upload, job start-up and the check: no worker group ever waited
    assert not list(tmp_path.iterdir())  # nothing written


def run_connect(env, address):
    code = ("import ray; from ray_diloco.presets import tiny_cpu; from ray_diloco.run_setup import training_groups;"
            "from ray_diloco.ray_connection import connect_ray; cfg = tiny_cpu();"
            f"connect_ray({address!r}, cfg, training_groups(cfg));"
            "print('GCS', ray.get_runtime_context().gcs_address, ray.cluster_resources()['CPU'])")
    env = {k: v for k, v in env.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)


def test_with_a_ray_start_cluster_running_train_starts_its_own_and_auto_attaches(small_head):
    private = run_connect(small_head.env, None)
    assert private.returncode == 0, private.stderr[-3000:]
    assert "started a private local Ray" in private.stdout
    gcs, cpus = private.stdout.split("GCS ")[1].split()
    assert not gcs.endswith(f":{small_head.port}") and float(cpus) >= 4  # sized for the run, not the head
    attached = run_connect(small_head.env, "auto")
    assert attached.returncode == 0, attached.stderr[-3000:]
    assert "attached to the Ray cluster" in attached.stdout
    assert attached.stdout.split("GCS ")[1].split()[0].endswith(f":{small_head.port}")


def wait_for_log(head: Head, job_id: str, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = subprocess.run([RAY, "job", "logs", job_id], env=head.env, capture_output=True, text=True).stdout
        if text in logs:
            return
        time.sleep(1)
    raise AssertionError(f"{text!r} not in the job's log after {timeout} s:\n{logs[-3000:]}")


def job_status(head: Head, job_id: str) -> str:
    done = subprocess.run([RAY, "job", "status", job_id], env=head.env, capture_output=True, text=True)
    return done.stdout + done.stderr


def readme_job_flags() -> list[str]:
    """The flags of the README's first `ray job submit … python jobs/train.py` command (its continuation lines
    joined, the comment after it dropped)."""
    readme = (ROOT / "README.md").read_text().split("### On a Ray cluster with `ray job submit`", 1)[1]
    command = readme.split("-- python jobs/train.py", 1)[1].split("\n")
    text = ""
    for line in command:
        text += " " + line.split("#", 1)[0].strip().rstrip("\\")
        if not line.split("#", 1)[0].rstrip().endswith("\\"):
            break
    return text.split()


@pytest.mark.timeout(900)  # three runs of the README's job: 368 s in CI
def test_ray_job_stop_checkpoints_and_a_resubmit_after_an_edit_continues_to_the_same_model(tmp_path):
    """The README's job flow: the same job submitted while the first runs is refused (one driver per region);
    `ray job stop` mid-run ends the run at the next outer step with a checkpoint and `stopped: true`; the same
    command submitted again after an edit to the working directory continues and ends with the θ_global and
    data fingerprint of a run that was never stopped."""
    from ray_diloco.cli import main

    head = Head(4, tmp_path)  # the README: `ray start --head --num-cpus 4`
    try:
        clone, storage = repository_copy(tmp_path), head.home / "ray_diloco_results"
        flags = readme_job_flags()  # the README's command, flag for flag
        assert flags[flags.index("--run-name") + 1] == "first" and flags[flags.index("--outer-steps") + 1] == "6"
        started = head.submit(clone, "--no-wait", *flags, cli_args_first=True)
        assert started.returncode == 0, started.stdout[-3000:]
        job_id = started.stdout.split("raysubmit_", 1)[1].split()[0].strip("'\"")
        job_id = f"raysubmit_{job_id}"
        # The same job submitted again while the first runs (a double click, a retry): refused in one line, as
        # soon as it sees the first driver renew its lease on the regions, before it writes or starts anything.
        wait_for_log(head, job_id, "[driver] run first: results in", timeout=300)
        again = head.submit(clone, *flags)
        assert again.returncode != 0, again.stdout[-3000:]
        assert "ray-diloco: error: region region-a is run by another driver" in again.stdout, again.stdout[-3000:]
        assert "Traceback" not in again.stdout, again.stdout[-3000:]
        wait_for_log(head, job_id, "outer step 1/6 synced", timeout=300)
        stop = subprocess.run([RAY, "job", "stop", job_id], env=head.env, capture_output=True, text=True, timeout=400)
        assert stop.returncode == 0 and "was stopped" in job_status(head, job_id), stop.stdout[-2000:] + stop.stderr
        first = json.loads((storage / "first" / "summary.json").read_text())
        assert first["stopped"] and 1 <= max(r["outer_step"] for r in first["rounds"]["region-a"]) + 1 < 6
        # Both regions ended at the same outer step, whichever SyncActor the stop reached first.
        ends = {region: [r["outer_step"] for r in rounds][-1:] for region, rounds in first["rounds"].items()}
        assert ends["region-a"] == ends["region-b"], run_story(first=first)

        (clone / "ray_diloco" / "__init__.py").write_text(  # any edit: Ray uploads a new package
            (clone / "ray_diloco" / "__init__.py").read_text() + "\n# edited between the two submits\n")
        second = head.submit(clone, *flags)
        assert second.returncode == 0, second.stdout[-4000:]
        assert "continuing run first from outer steps" in second.stdout, second.stdout[-4000:]
        resumed = json.loads((storage / "first" / "summary.json").read_text())
    finally:
        head.stop()
    assert not resumed["stopped"] and resumed["regions_agree"]
    assert [e["event"] for e in resumed["events"]].count("resumed") == 2

    # The same run, never stopped (a private local Ray in this process, shut down after it).
    import ray

    try:
        whole_flags = [("whole" if previous == "--run-name" else flag) for previous, flag in zip([""] + flags, flags)]
        assert main(["train", *whole_flags, "--output-dir", str(storage)]) == 0
    finally:
        ray.shutdown()
    whole = json.loads((storage / "whole" / "summary.json").read_text())
    assert resumed["data_fingerprint"] == whole["data_fingerprint"]  # no window twice, none skipped
    a, b = (load_file(storage / name / "model" / "model.safetensors") for name in ("first", "whole"))
    assert a.keys() == b.keys()
    story = run_story(first=first, resumed=resumed, whole=whole)  # where they part: which round, who was in it
    for key in a:  # the same θ_global, to the fp16 wire's rounding
        assert torch.allclose(a[key], b[key], rtol=0, atol=1e-3), (key, story)


def run_story(**summaries: dict) -> str:
    """What a failed comparison needs: each run's rounds (region, outer step, group, consistent) and events."""
    lines = []
    for name, summary in summaries.items():
        lines.append(f"{name} (stopped: {summary.get('stopped')}):")
        for region, rounds in summary["rounds"].items():
            lines.append(f"  {region}: " + ", ".join(
                f"{r['outer_step']}/{r['group_size']}{'' if r.get('consistent', True) else '!'}/{r['digest'][:8]}"
                for r in rounds))
        lines += [f"  {e}" for e in summary["events"]]
    return "\n".join(lines)
