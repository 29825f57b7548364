"""A preemption notice that comes early in a window longer than the notice: the group hands in the inner steps it
trained (a shorter window), so its round and checkpoint end before the deadline, and the group Ray Train starts in
its place continues from that checkpoint, AdamW included (ray_diloco/preemption.py: `hands_in_early`).

One region on a Ray head with Ray's own autoscaler (tests/autoscaling_head.py: the fake multi-node provider, worker
nodes of 2 CPUs labelled `us`, one at least). Its driver is `ray-diloco train --address` of the head, in a process
of its own. Right after a round ends, the node its worker runs on is drained with reason PREEMPTION and a deadline
shorter than a window (the cloud's notice); at the deadline Ray Train ends the group, the test kills the node, and
the autoscaler starts another, where the group restarts. Without the early hand-in this window would be cut off:
no checkpoint (`run.checkpoint_every: 0`), and the restarted group would start AdamW anew (`inner_state_reset`).
The run has `outer.overlap: true`: the workers train on while a round runs, except where a notice stands (a round
that overlaps cannot be checkpointed). Checks that the window ended early (`window_ended_early`, fewer than H
steps, its round's tokens that many), that its round did not overlap (the rounds before it did) and was
checkpointed under the notice, the group waited for the deadline on it, and the group that followed restored
exactly that checkpoint (`inner_state_restored`); and that the run finished.
"""

import json
from pathlib import Path

import pytest
import ray
import yaml
from autoscaling_head import one_region_head, watching
from conftest import Driver, alive, driver_env, events_of, named_actor, wait_for, while_running
from ray_diloco.config import ExperimentConfig
from ray_diloco.driver import run_actor_name
from ray_diloco.presets import tiny_cpu
from ray_diloco.worker_checkpoint import checkpoint_name

# A window of H inner steps takes about 30 s here (tiny preset, 1 worker on 2 CPUs): twice the notice, so the rest
# of the window with its round does not fit twice before the deadline (ray_diloco/preemption.py) on a machine up to
# twice as fast, while Ray Train's watcher (a poll every 5 s) and a mid-window look (every ninth of the window)
# still see the notice with time for a round of one region and its checkpoint (a second here).
INNER_STEPS = 60
NOTICE_SECONDS = 15
OUTER_STEPS = 3


def run_yaml(tmp_path: Path) -> Path:
    cfg = tiny_cpu().to_dict()
    cfg["regions"] = [{"name": "us", "workers": 1, "cpus_per_worker": 2}]
    cfg["outer"].update(inner_steps=INNER_STEPS, overlap=True)
    cfg["run"].update(name="notice", outer_steps=OUTER_STEPS, checkpoint_every=0, eval_every=0, max_failures=0,
                      output_dir=str(tmp_path / "out"), checkpoint_path=str(tmp_path / "bucket"))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.timeout(900)
def test_a_notice_shorter_than_the_window_ends_it_early_and_the_next_group_restores_its_checkpoint(tmp_path):
    config = run_yaml(tmp_path)
    cfg = ExperimentConfig.from_yaml(config.read_text())
    head = one_region_head(tmp_path, "us", idle_minutes=5)
    drivers: dict[str, Driver] = {}
    running = while_running(drivers)

    with watching(head, drivers):
        wait_for(lambda: head.worker_nodes(), 300, "the autoscaler's first node")
        driver = drivers["us"] = Driver(["--config", str(config), "--local-regions", "us", "--address", head.address],
                                        driver_env())
        actor = running(lambda: named_actor(run_actor_name("sync", cfg, "us"), head.address), 300, "us's SyncActor")
        running(lambda: ray.get(actor.outer_step.remote()) >= 1, 600, "us's first round")
        noticed_at = ray.get(actor.outer_step.remote())
        (node,) = ray.get(actor.stats.remote())["worker_nodes"]  # where the worker runs: a window has just begun
        worker_pids = list(ray.get(actor.worker_pids.remote()).values())
        head.drain(node, deadline_seconds=NOTICE_SECONDS)
        running(lambda: not any(alive(pid) for pid in worker_pids), NOTICE_SECONDS + 120,
                "Ray Train to end the group at the preemption's deadline")
        head.kill_node(node)  # the cloud takes the node; the autoscaler starts another where there is none
        running(lambda: events_of(actor, "inner_state_restored") or events_of(actor, "inner_state_reset"), 600,
                "the group to restart on a new node")
        assert driver.process.wait(timeout=600) == 0, f"the driver failed:\n{driver.output()[-3000:]}"

    summary = json.loads((tmp_path / "out" / "notice" / "summary.json").read_text())
    events = summary["events"]
    early = [e for e in events if e["event"] == "window_ended_early"]
    # The notice came early in the window towards outer step noticed_at + 1 (seen within Ray Train's poll, 5 s, and
    # a look, a ninth of the window): that window ended early, the only one.
    assert [e["outer_step"] for e in early] == [noticed_at], events
    assert 0 < early[0]["inner_steps"] < INNER_STEPS and early[0]["of"] == INNER_STEPS, early
    (its_round,) = [r for r in summary["rounds"]["us"] if r["outer_step"] == early[0]["outer_step"]]
    assert its_round["tokens"] == early[0]["inner_steps"] * cfg.data.batch_size * cfg.data.seq_len, its_round
    # Under the notice the round blocked, to be checkpointed; the rounds before it ran while the workers trained on.
    assert not its_round["overlapped"], its_round
    assert all(r["overlapped"] for r in summary["rounds"]["us"] if r["outer_step"] < early[0]["outer_step"])
    notices = [e for e in events if e["event"] == "preemption_notice"]
    assert [(e["outer_step"], e["waits_for_deadline"]) for e in notices] == [(early[0]["outer_step"] + 1, True)]
    restarted = [e for e in events if e["event"].startswith("inner_state_")]
    assert restarted[0]["event"] == "inner_state_restored", events  # not reset: the window was not lost
    assert checkpoint_name(early[0]["outer_step"] + 1, token="") in restarted[0]["checkpoint"], restarted
    assert summary["outer_steps"] == OUTER_STEPS
