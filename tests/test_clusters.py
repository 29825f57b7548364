"""One Ray cluster per region, joined only by Hivemind and shared storage, each run with `ray job submit`.

Two heads (`ray start --head`, ports of their own, one shared auth token) on this machine stand for two regions'
clusters. The README's config lists the run's three regions; each cluster's job runs `--local-regions <its
region>`; a directory stands for the shared bucket (checkpoints, peer files, results). No multiaddrs are copied:
every SyncActor writes its own to `<storage>/<run>/peers/<region>.json` and dials the others'. Checks that:
* us and eu find each other (`peer_connected`), average together in every round and agree bit for bit on
  θ_global after every outer step and at the end;
* they read disjoint, non-empty file lists, split over the run's three regions (not per cluster);
* every region logged its multiaddrs (`hivemind_started`) and wrote them to its peer file.
A third cluster joining mid-run is tested in tests/test_faults.py (the come-and-go run: the joiner's driver has a
Ray of its own; on one loaded machine a third `ray start` head did not come up in time).
"""

import json
import re
import time
from pathlib import Path

import pytest
from test_job_submit import RAY, ROOT, Head, job_status

from ray_diloco.config import ExperimentConfig

REGIONS = ("us", "eu", "ap")
OUTER_STEPS = 6
RUNNING = ("us", "eu")  # ap is in the config (the data split counts it) but its cluster is not started here


def run_config(storage) -> str:
    """The README's run.yaml (section "One Ray cluster per region"), with this test's directory as the bucket."""
    readme = (ROOT / "README.md").read_text()
    text = readme.split("# run.yaml, the same in every cluster\n")[1].split("```")[0]
    path = storage / "run.yaml"
    path.write_text(text.replace("/shared/bucket", str(storage)))
    cfg = ExperimentConfig.from_yaml(path.read_text())
    assert [r.name for r in cfg.regions] == list(REGIONS) and cfg.run.outer_steps == OUTER_STEPS
    return str(path)


def submit(head: Head, config: str, region: str) -> str:
    done = head.submit(ROOT, "--no-wait", "--config", config, "--local-regions", region, cli_args_first=True,
                       timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return re.search(r"raysubmit_[A-Za-z0-9]+", done.stdout + done.stderr).group(0)


def wait_until_done(jobs: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = dict(jobs)
    while pending and time.monotonic() < deadline:
        for region, (head, job_id) in list(pending.items()):
            status = job_status(head, job_id)
            if "Failed to connect" in status or "Status for job" in status:
                continue  # still pending or running, or the dashboard did not answer (a loaded machine)
            if "succeeded" in status or " failed" in status or "was stopped" in status:
                assert "succeeded" in status, f"{region}: {status}\n" + logs(head, job_id)
                del pending[region]
        time.sleep(3)
    assert not pending, {region: logs(head, job_id) for region, (head, job_id) in pending.items()}


def logs(head: Head, job_id: str) -> str:
    import subprocess

    return subprocess.run([RAY, "job", "logs", job_id], env=head.env, capture_output=True, text=True).stdout[-4000:]


@pytest.fixture
def heads(tmp_path):
    started = []

    def start():
        # One token for all heads: on one machine, a job driver of one head may read another's session (not so
        # with one head per region on machines of their own).
        started.append(Head(4, tmp_path, token=started[0].token if started else None))
        return started[-1]

    yield start
    for head in started:
        head.begin_stop()
    for head in started:
        head.finish_stop()


def test_two_clusters_find_each_other_train_together_and_agree(heads, tmp_path):
    storage = tmp_path / "bucket"
    storage.mkdir()
    config = run_config(storage)
    us, eu = heads(), heads()
    jobs = {"us": (us, submit(us, config, "us")), "eu": (eu, submit(eu, config, "eu"))}
    wait_until_done(jobs, timeout=900)

    results = storage / "results" / "clusters"
    summaries = {region: json.loads((results / f"summary-{region}.json").read_text()) for region in RUNNING}
    rounds = {region: summaries[region]["rounds"][region] for region in RUNNING}
    assert [r["outer_step"] for r in rounds["us"]] == list(range(OUTER_STEPS))
    for us_round, eu_round in zip(rounds["us"], rounds["eu"], strict=True):
        assert us_round["digest"] == eu_round["digest"], (us_round, eu_round)
        assert us_round["group_size"] == eu_round["group_size"] == 2 and us_round["consistent"]
    assert summaries["us"]["global_digest"]["us"] == summaries["eu"]["global_digest"]["eu"]

    # the split is over the run's three regions (ap's share stays unread here), not over what a cluster runs
    files = {region: {Path(f).name for f in summaries[region]["data_files"][region]} for region in RUNNING}
    assert all(files.values()) and not files["us"] & files["eu"], files
    assert len(files["us"] | files["eu"]) < 8  # the sample's 8 files: a third went to ap

    for region in RUNNING:
        started = [e for e in summaries[region]["events"] if e["event"] == "hivemind_started"]
        assert started and started[0]["multiaddrs"], summaries[region]["events"]
        written = json.loads((storage / "clusters" / "peers" / f"{region}.json").read_text())
        assert written["multiaddrs"] == started[0]["multiaddrs"]
        assert [e["peer"] for e in summaries[region]["events"] if e["event"] == "peer_connected"], region
