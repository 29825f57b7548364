"""A preemption notice whose round outlives the group, in a run of two regions whose other region is late: the
workers save their part of the round's checkpoint under the notice (worker.save_at_hand_in), the region's SyncActor
commits it as the round ends, the group gone, and the group Ray Train starts in its place continues from it, AdamW
included. Two schedules (`comes`):
- MID_WINDOW: the notice comes early in a window longer than the notice: the group hands in the inner steps it
  trained (a shorter window, ray_diloco/preemption.py: `hands_in_early`), saving the checkpoint as it does.
- IN_THE_ROUND: it comes after the group handed in a whole window, as the round waits for the other region: a look
  in the round finds it (worker.wait_for_round), the workers save then, and the SyncActor takes that checkpoint for
  the round (`late_hand_in`). This schedule once failed the MID_WINDOW test in CI (the other region was late to
  start); before the looks in the round, nothing was saved and the next group started AdamW anew.

Region us runs on a Ray head with Ray's own autoscaler (tests/autoscaling_head.py: the fake multi-node provider,
worker nodes of 2 CPUs labelled `us`, one at least); its driver is `ray-diloco train --address` of the head,
`--local-regions us`, whose workers are held before their first exchange until eu has handed in its first window, so
that us's first round ends as us hands in. Region eu is a cluster of its own: a driver with a private Ray,
`--local-regions eu`, whose workers are held before the exchange of outer step 1 (`RAY_DILOCO_TEST_SLOW_REGION`)
until the test lets them go. Right after us's first round
(MID_WINDOW), or once us handed in its next window (IN_THE_ROUND), the node its worker runs on is drained with reason
PREEMPTION and a deadline shorter than a window (the cloud's notice); at the deadline Ray Train ends the group, still
in the round; then eu is let go, the round of both ends, the test kills the node, and the autoscaler starts another,
where us's group restarts. That round is the run's last (2 outer steps, to keep the test short): the group restores
the state and ends. Without the hand-in checkpoint the round, ended after the group, left none
(`run.checkpoint_every: 0`) and the restarted group started AdamW anew (`inner_state_reset`); without the early
hand-in the window would have been cut off. The run has `outer.overlap: true`: the workers train on while a round
runs, except where a notice stands (a round that overlaps cannot be checkpointed).

Checks: MID_WINDOW: the window ended early (`window_ended_early`, fewer than H steps, its round's tokens that many);
IN_THE_ROUND: a whole window, and the checkpoint saved in the round was taken (`saved_in_round`). Both: the round did
not overlap (the rounds before it did) and met eu; the group was gone before eu handed in; the checkpoint the next
group restored (`inner_state_restored`) is that round's hand-in one (`holds_theta_global` false, named after the step
handed in); both regions finished on one θ_global.
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
from ray_diloco.worker import SLOW_REGION_ENV_VAR
from ray_diloco.worker_checkpoint import META_FILE, checkpoint_name

# A window of H inner steps takes about 30 s here (tiny preset, 1 worker on 2 CPUs; longer while eu trains too, up to
# 200 s in a loaded CI): twice the notice at least, so the rest of the window with its round does not fit twice
# before the deadline (ray_diloco/preemption.py) on a machine up to twice as fast, while Ray Train's watcher (a poll
# every 5 s) and a mid-window look (a ninth of the window, and at least every 5 s of training: the notice's window is
# the group's second, its first timed the steps) still see the notice with time for the hand-in's checkpoint. With
# looks a ninth of the window apart only, 3.4 s steps once put them 24 s apart and the notice went unseen (CI).
INNER_STEPS = 60
NOTICE_SECONDS = 15
OUTER_STEPS = 2  # the notice's round is the last: the group that follows restores, then finishes
MID_WINDOW = "mid-window"  # the notice comes as us trains the window of the last round
IN_THE_ROUND = "in-the-round"  # it comes after us handed that window in, as the round waits for eu


def run_yaml(tmp_path: Path) -> Path:
    cfg = tiny_cpu().to_dict()
    cfg["regions"] = [{"name": "us", "workers": 1, "cpus_per_worker": 2}, {"name": "eu", "workers": 1}]
    # us's round waits for eu as long as the test holds eu (a region late by minutes, not one gone)
    cfg["outer"].update(inner_steps=INNER_STEPS, overlap=True, max_wait_seconds=300)
    cfg["run"].update(name="notice", outer_steps=OUTER_STEPS, checkpoint_every=0, eval_every=0, max_failures=0,
                      output_dir=str(tmp_path / "out"), checkpoint_path=str(tmp_path / "bucket"))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("comes", [MID_WINDOW, IN_THE_ROUND])
def test_a_notice_whose_round_outlives_its_group_leaves_the_next_group_the_hand_in_checkpoint(tmp_path, comes):
    config = run_yaml(tmp_path)
    cfg = ExperimentConfig.from_yaml(config.read_text())
    gate = tmp_path / "eu-may-go"
    # us's workers wait before their first exchange until eu has handed in its first window (us's cluster runs them
    # with the variable): us's first round then ends as us hands in, and the drain below finds us's next window just
    # begun. Without the wait, eu (a Ray of its own to start) once handed in 99 s after us, and once (with us started
    # after eu's first step) us's first round still ended late in us's next window: both times the drain found the
    # workers waiting in the last round, IN_THE_ROUND's schedule, and MID_WINDOW failed in CI.
    us_gate = tmp_path / "us-may-hand-in"
    head = one_region_head(tmp_path, "us", idle_minutes=5, env={SLOW_REGION_ENV_VAR: f"us:{us_gate}"})
    drivers: dict[str, Driver] = {}
    running = while_running(drivers)

    with watching(head, drivers):
        wait_for(lambda: head.worker_nodes(), 300, "the autoscaler's first node")
        drivers["eu"] = Driver(["--config", str(config), "--local-regions", "eu"],
                               driver_env(**{SLOW_REGION_ENV_VAR: f"eu:{gate}:1"}))
        drivers["us"] = Driver(["--config", str(config), "--local-regions", "us", "--address", head.address],
                               driver_env())
        actor = running(lambda: named_actor(run_actor_name("sync", cfg, "us"), head.address), 300, "us's SyncActor")
        drivers["eu"].wait_for_line(f"[eu] outer step 1/{OUTER_STEPS} ", 600)  # eu's exchange answered: handed in
        us_gate.touch()
        running(lambda: ray.get(actor.outer_step.remote()) >= 1, 900, "us's first round")
        handed_in = ray.get(actor.outer_step.remote())  # the step of the round the notice's window hands in
        if comes == IN_THE_ROUND:
            running(lambda: ray.get(actor.stats.remote())["rounds_handed_in"] == [handed_in], 300,
                    "us to hand in its window and wait in the round for eu")
        (node,) = ray.get(actor.stats.remote())["worker_nodes"]
        worker_pids = list(ray.get(actor.worker_pids.remote()).values())
        head.drain(node, deadline_seconds=NOTICE_SECONDS)
        running(lambda: not any(alive(pid) for pid in worker_pids), NOTICE_SECONDS + 180,
                "Ray Train to end the group at the preemption's deadline")
        in_round_at_deadline = ray.get(actor.outer_step.remote()) == handed_in and ray.get(
            actor.stats.remote())["rounds_handed_in"] == [handed_in]
        gate.touch()  # eu hands in: the round of both ends, after us's group
        head.kill_node(node)  # the cloud takes the node; the autoscaler starts another where there is none
        # That round is the run's last: eu finishes, and its driver may exit before us's group is back (a CI run:
        # eu's summary 7 s before us's restart), so only us's driver must still run here.
        while_running({"us": drivers["us"]})(
            lambda: events_of(actor, "inner_state_restored") or events_of(actor, "inner_state_reset"), 600,
            "the group to restart on a new node")
        for name, driver in drivers.items():
            assert driver.process.wait(timeout=600) == 0, f"{name}'s driver failed:\n{driver.output()[-3000:]}"

    results = tmp_path / "out" / "notice"
    summary = {region: json.loads((results / f"summary-{region}.json").read_text()) for region in ("us", "eu")}
    events = summary["us"]["events"]
    early = [e for e in events if e["event"] == "window_ended_early"]
    saved_in_round = [e for e in events if e["event"] == "saved_in_round"]
    (its_round,) = [r for r in summary["us"]["rounds"]["us"] if r["outer_step"] == handed_in]
    if comes == MID_WINDOW:
        # The notice came early in the window (seen within Ray Train's poll, 5 s, and a look, at most 5 s of steps):
        # that window ended early, the only one, and its checkpoint was saved as it handed in.
        assert [e["outer_step"] for e in early] == [handed_in], events
        assert 0 < early[0]["inner_steps"] < INNER_STEPS and early[0]["of"] == INNER_STEPS, early
        assert its_round["tokens"] == early[0]["inner_steps"] * cfg.data.batch_size * cfg.data.seq_len, its_round
        assert not saved_in_round, events
    else:
        # The whole window was handed in; the notice came as the round waited for eu: a look in the round found it
        # (worker.wait_for_round, every ROUND_LOOK_SECONDS) and the SyncActor took the checkpoint saved then.
        assert not early, events
        assert its_round["tokens"] == INNER_STEPS * cfg.data.batch_size * cfg.data.seq_len, its_round
        assert [(e["outer_step"], e["taken"]) for e in saved_in_round] == [(handed_in, True)], events
    assert in_round_at_deadline, events  # the group ended with its round still waiting for eu
    assert its_round["group_size"] == 2 and "eu" in its_round["peers"], its_round
    # Under the notice the round blocked, to be checkpointed (and it is the run's last); the rounds before it ran
    # while the workers trained on.
    assert not its_round["overlapped"], its_round
    assert all(r["overlapped"] for r in summary["us"]["rounds"]["us"] if r["outer_step"] < handed_in)
    restarted = [e for e in events if e["event"].startswith("inner_state_")]
    assert restarted[0]["event"] == "inner_state_restored", events  # not reset: the window was not lost
    # saved for the round of the step handed in (named after it), committed with the step its round reached
    assert checkpoint_name(handed_in, token="") in restarted[0]["checkpoint"], restarted
    assert restarted[0]["outer_step"] == handed_in + 1, restarted
    meta = json.loads((Path(restarted[0]["checkpoint"]) / META_FILE).read_text())  # the bucket is a local path here
    assert not meta["holds_theta_global"] and meta["outer_step"] == handed_in, meta
    assert summary["us"]["outer_steps"] == summary["eu"]["outer_steps"] == OUTER_STEPS
    assert summary["us"]["global_digest"]["us"] == summary["eu"]["global_digest"]["eu"]
