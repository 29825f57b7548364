"""Preemption notices whose rounds outlive the group, in a run of two regions whose other region is late: the
workers save their part of the round's checkpoint under the notice (worker.save_at_hand_in), the region's SyncActor
commits it as the round ends, the group gone, and the group Ray Train starts in its place continues from it, AdamW
included. One run, two notices, each schedule in a round of its own (round 0 meets eu first):
- MID_WINDOW (round 1): the notice comes early in a window longer than the notice: the group hands in the inner
  steps it trained (a shorter window, ray_diloco/preemption.py: `hands_in_early`), saving the checkpoint as it does.
- IN_THE_ROUND (round 2, the run's last): it comes after the group (restarted after the first notice) handed in a
  whole window, as the round waits for the other region: a look in the round finds it (worker.wait_for_round), the
  workers save then, and the SyncActor takes that checkpoint for the round (`late_hand_in`). This schedule once
  failed a MID_WINDOW test in CI (the other region was late to start); before the looks in the round, nothing was
  saved and the next group started AdamW anew.

Region us runs on a Ray head with Ray's own autoscaler (tests/autoscaling_head.py: the fake multi-node provider,
worker nodes of 2 CPUs labelled `us`, one at least); its driver is `ray-diloco train --address` of the head,
`--local-regions us`, whose workers are held before their first exchange until eu has handed in its first window, so
that us's first round ends as us hands in. Region eu is a cluster of its own: a driver with a private Ray,
`--local-regions eu`, whose workers are held before each exchange from outer step 1 on (`RAY_DILOCO_TEST_SLOW_REGION`,
a gate file per step) until the test lets them go. Right after us's first round (MID_WINDOW), and once the next group
handed in the last window (IN_THE_ROUND), the node its worker runs on is drained with reason PREEMPTION and a
deadline shorter than a window (the cloud's notice); at the deadline Ray Train ends the group, still in the round;
then eu is let go, the round of both ends, the test kills the node, and the autoscaler starts another, where us's
group restarts. Without the hand-in checkpoint the round, ended after the group, left none (`run.checkpoint_every:
0`) and the restarted group started AdamW anew (`inner_state_reset`); without the early hand-in the window would
have been cut off. The run has `outer.overlap: true`: the workers train on while a round runs, except where a notice
stands (a round that overlaps cannot be checkpointed).

Checks: MID_WINDOW: the window ended early (`window_ended_early`, fewer than H steps, its round's tokens that many);
IN_THE_ROUND: a whole window, and the checkpoint saved in the round was taken (`saved_in_round`). Both: the round did
not overlap (the one before the first did) and met eu; the group was gone before eu handed in; the checkpoint the
next group restored (`inner_state_restored`) is that round's hand-in one (`holds_theta_global` false, named after the
step handed in); both regions finished on one θ_global.
"""

import json
import time
from pathlib import Path

import pytest
import ray
import yaml
from autoscaling_head import one_region_head, watching
from conftest import Driver, alive, driver_env, events_of, named_actor, wait_for, while_running
from ray_diloco.config import ExperimentConfig
from ray_diloco.driver import run_actor_name
from ray_diloco.presets import tiny_cpu
from ray_diloco.worker import SLOW_REGION_ENV_VAR, STEP_IN_GATE, gate_for_step
from ray_diloco.worker import test_slowdown as hold_before_exchange  # not a test of this module
from ray_diloco.worker_checkpoint import META_FILE, checkpoint_name

# A window of H inner steps takes about 30 s here (tiny preset, 1 worker on 2 CPUs; longer while eu trains too, up to
# 200 s in a loaded CI): twice the notice at least, so the rest of the window with its round does not fit twice
# before the deadline (ray_diloco/preemption.py) on a machine up to twice as fast, while Ray Train's watcher (a poll
# every 5 s) and a mid-window look (a ninth of the window, and at least every 5 s of training: the notice's window is
# the group's second, its first timed the steps) still see the notice with time for the hand-in's checkpoint. With
# looks a ninth of the window apart only, 3.4 s steps once put them 24 s apart and the notice went unseen (CI).
INNER_STEPS = 60
NOTICE_SECONDS = 15
# Round 0 both regions; round 1's window gets the first notice (MID_WINDOW), round 2's (the last) the second
# (IN_THE_ROUND): the group that follows it restores, then finishes.
OUTER_STEPS = 3


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


def test_a_step_in_a_gate_holds_each_round_at_its_own_file(tmp_path, monkeypatch, capsys):
    """The hook the schedule below relies on: "{step}" in the gate's path, one file per outer step."""
    monkeypatch.setenv(SLOW_REGION_ENV_VAR, f"eu:{tmp_path}/go-{STEP_IN_GATE}:1")
    monkeypatch.setattr("ray_diloco.worker.GATE_TIMEOUT_SECONDS", 1.0)
    (tmp_path / "go-1").touch()
    waited = {}
    for step in (0, 1, 2):
        started = time.monotonic()
        hold_before_exchange("eu", step)
        waited[step] = time.monotonic() - started
    assert waited[0] < 0.5 and waited[1] < 0.5 and waited[2] >= 1.0, waited  # step 0 not held; 2 has no file
    assert capsys.readouterr().out == f"[eu] test gate {tmp_path}/go-2 not there after 1 s: going on\n"


def notice_and_restart(head, actor, drivers: dict, handed_in: int, eu_gate: Path, restarts: int) -> bool:
    """Drain the node us's worker runs on with a deadline (the cloud's notice), wait for Ray Train to end the group
    at it, let eu hand in (the round of both ends, after us's group), kill the node (the autoscaler starts another)
    and wait for the group's restart there (its `restarts`-th). Returns whether the group ended with its round still
    waiting for eu. `drivers`: those that must still run while the group restarts."""
    running = while_running(drivers)
    nodes = ray.get(actor.stats.remote())["worker_nodes"]  # in order of first use: one per group so far
    assert len(nodes) == restarts, nodes
    node = nodes[-1]
    worker_pids = list(ray.get(actor.worker_pids.remote()).values())
    head.drain(node, deadline_seconds=NOTICE_SECONDS)
    running(lambda: not any(alive(pid) for pid in worker_pids), NOTICE_SECONDS + 180,
            "Ray Train to end the group at the preemption's deadline")
    stats = ray.get(actor.stats.remote())
    in_round_at_deadline = stats["outer_step"] == handed_in and stats["rounds_handed_in"] == [handed_in]
    eu_gate.touch()
    head.kill_node(node)
    restarted = lambda: events_of(actor, "inner_state_restored") + events_of(actor, "inner_state_reset")
    running(lambda: len(restarted()) >= restarts, 600, f"the group's restart {restarts} on a new node")
    return in_round_at_deadline


@pytest.mark.long  # ~10 min here: not in the default run (pyproject.toml)
@pytest.mark.timeout(1500)
def test_notices_mid_window_and_in_the_round_leave_the_next_group_the_hand_in_checkpoint(tmp_path):
    config = run_yaml(tmp_path)
    cfg = ExperimentConfig.from_yaml(config.read_text())
    eu_gate = str(tmp_path / f"eu-may-hand-in-{STEP_IN_GATE}")  # eu holds before each exchange from step 1 on
    # us's workers wait before their first exchange until eu has handed in its first window (us's cluster runs them
    # with the variable): us's first round then ends as us hands in, and the drain below finds us's next window just
    # begun. Without the wait, eu (a Ray of its own to start) once handed in 99 s after us, and once (with us started
    # after eu's first step) us's first round still ended late in us's next window: both times the drain found the
    # workers waiting in the round, not training the window (MID_WINDOW failed in CI).
    us_gate = tmp_path / "us-may-hand-in"
    head = one_region_head(tmp_path, "us", idle_minutes=5, env={SLOW_REGION_ENV_VAR: f"us:{us_gate}"})
    drivers: dict[str, Driver] = {}
    running = while_running(drivers)

    with watching(head, drivers):
        wait_for(lambda: head.worker_nodes(), 300, "the autoscaler's first node")
        drivers["eu"] = Driver(["--config", str(config), "--local-regions", "eu"],
                               driver_env(**{SLOW_REGION_ENV_VAR: f"eu:{eu_gate}:1"}))
        drivers["us"] = Driver(["--config", str(config), "--local-regions", "us", "--address", head.address],
                               driver_env())
        actor = running(lambda: named_actor(run_actor_name("sync", cfg, "us"), head.address), 300, "us's SyncActor")
        drivers["eu"].wait_for_line(f"[eu] outer step 1/{OUTER_STEPS} ", 600)  # eu's exchange answered: handed in
        us_gate.touch()
        running(lambda: ray.get(actor.outer_step.remote()) >= 1, 900, "us's first round")
        mid_window = ray.get(actor.outer_step.remote())  # the step of the round the first notice's window hands in
        # MID_WINDOW: right after us's first round, as its group trains the next window.
        assert mid_window == 1, mid_window  # eu is held before round 1's exchange: us cannot be further
        ended_in_round = [notice_and_restart(head, actor, drivers, mid_window,
                                             Path(gate_for_step(eu_gate, mid_window)), restarts=1)]
        # IN_THE_ROUND: the restarted group trains the last window, hands it in and waits in the round for eu.
        last_step = mid_window + 1
        running(lambda: ray.get(actor.stats.remote())["rounds_handed_in"] == [last_step], 600,
                "us to hand in its last window and wait in the round for eu")
        # After the run's last round eu finishes, and its driver may exit before us's group is back (a CI run: eu's
        # summary 7 s before us's restart): only us's driver must still run then.
        ended_in_round.append(notice_and_restart(head, actor, {"us": drivers["us"]}, last_step,
                                                 Path(gate_for_step(eu_gate, last_step)), restarts=2))
        for name, driver in drivers.items():
            assert driver.process.wait(timeout=600) == 0, f"{name}'s driver failed:\n{driver.output()[-3000:]}"

    results = tmp_path / "out" / "notice"
    summary = {region: json.loads((results / f"summary-{region}.json").read_text()) for region in ("us", "eu")}
    events = summary["us"]["events"]
    rounds = {r["outer_step"]: r for r in summary["us"]["rounds"]["us"]}
    assert sorted(r["outer_step"] for r in summary["us"]["rounds"]["us"]) == list(range(OUTER_STEPS)), rounds
    assert ended_in_round == [True, True], events  # each group ended with its round still waiting for eu
    # MID_WINDOW: the notice came early in the window (seen within Ray Train's poll, 5 s, and a look, at most 5 s of
    # steps): that window ended early, the only one, and its checkpoint was saved as it handed in.
    early = [e for e in events if e["event"] == "window_ended_early"]
    assert [e["outer_step"] for e in early] == [mid_window], events
    assert 0 < early[0]["inner_steps"] < INNER_STEPS and early[0]["of"] == INNER_STEPS, early
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    assert rounds[mid_window]["tokens"] == early[0]["inner_steps"] * tokens_per_step, rounds[mid_window]
    # IN_THE_ROUND: the whole window was handed in; the notice came as the round waited for eu: a look in the round
    # found it (worker.wait_for_round, every ROUND_LOOK_SECONDS) and the SyncActor took the checkpoint saved then.
    saved_in_round = [(e["outer_step"], e["taken"]) for e in events if e["event"] == "saved_in_round"]
    assert saved_in_round == [(last_step, True)], events
    assert rounds[last_step]["tokens"] == INNER_STEPS * tokens_per_step, rounds[last_step]
    for step in (mid_window, last_step):
        # Under a notice the round blocked, to be checkpointed; it met eu.
        assert not rounds[step]["overlapped"] and rounds[step]["group_size"] == 2, rounds[step]
        assert "eu" in rounds[step]["peers"], rounds[step]
    assert all(r["overlapped"] for step, r in rounds.items() if step < mid_window)  # the workers trained on
    restarted = [e for e in events if e["event"].startswith("inner_state_")]
    assert [e["event"] for e in restarted] == ["inner_state_restored"] * 2, events  # not reset: no window lost
    for restart, step in zip(restarted, (mid_window, last_step)):
        # saved for the round of the step handed in (named after it), committed with the step its round reached
        assert checkpoint_name(step, token="") in restart["checkpoint"], restart
        assert restart["outer_step"] == step + 1, restart
        meta = json.loads((Path(restart["checkpoint"]) / META_FILE).read_text())  # the bucket: a local path here
        assert not meta["holds_theta_global"] and meta["outer_step"] == step, meta
    assert summary["us"]["outer_steps"] == summary["eu"]["outer_steps"] == OUTER_STEPS
    assert summary["us"]["global_digest"]["us"] == summary["eu"]["global_digest"]["eu"]
