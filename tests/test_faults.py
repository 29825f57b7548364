"""Fault injection on real processes (kill by PID, `ray.kill`) and regions joining mid-run.

- A worker killed inside a region: the region's Ray Train group restarts (FailureConfig), its new workers
  load θ_global from the region's SyncActor (which kept the outer state) and the run finishes.
- One of three regions killed: the other two finish every outer step, agree bit for bit, and no round
  waits longer than the matchmaking window.
- A region joining after outer step 2 loads θ_global from its peers over Hivemind (bit-identical) and
  takes part in the following rounds.
"""

import dataclasses
import os
import signal

import ray
import torch

from conftest import RunInThread, small_run, wait_for
from ray_diloco.config import RegionConfig
from ray_diloco.driver import run_training


def sync_actor(cfg, region):
    return ray.get_actor(f"diloco-sync-{cfg.run.name}-{region}")


def test_worker_killed_inside_a_region_restarts_and_the_run_finishes(local_ray, tmp_path):
    cfg = small_run(tmp_path, "kill-worker", workers=[1, 2], inner_steps=3, outer_steps=3,
                    matchmaking_seconds=90.0, max_failures=1)
    run = RunInThread(lambda: run_training(cfg))
    actor = wait_for(lambda: sync_actor(cfg, "r1"), 180, "r1's SyncActor")
    wait_for(lambda: ray.get(actor.outer_step.remote()) >= 1, 300, "r1's first outer step")
    pids = ray.get(actor.worker_pids.remote())
    os.kill(pids[1], signal.SIGKILL)  # rank 1 of the 2-worker region, between outer steps 1 and 3

    summary = run.join(timeout=600)
    restarts = [e for e in summary["events"] if e["event"] == "worker_restart"]
    assert restarts and {e["region"] for e in restarts} == {"r1"}, summary["events"]
    for region in ("r0", "r1"):
        assert [r["outer_step"] for r in summary["rounds"][region]] == [0, 1, 2]
    assert summary["regions_agree"], summary["global_digest"]
    assert summary["eval_loss"] < summary["eval_loss_at_start"]


def test_one_of_three_regions_killed_the_others_finish_and_agree(local_ray, tmp_path):
    matchmaking = 15.0
    cfg = small_run(tmp_path, "kill-region", workers=[1, 1, 1], inner_steps=3, outer_steps=4,
                    matchmaking_seconds=matchmaking, max_failures=0)
    run = RunInThread(lambda: run_training(cfg))
    victim = wait_for(lambda: sync_actor(cfg, "r2"), 180, "r2's SyncActor")
    wait_for(lambda: ray.get(victim.outer_step.remote()) >= 1, 300, "r2's first outer step")
    pids = ray.get(victim.worker_pids.remote())
    ray.kill(victim)  # the region vanishes: its SyncActor and its worker
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)

    summary = run.join(timeout=600)
    assert [e["region"] for e in summary["events"] if e["event"] == "region_departed"] == ["r2"]
    for region in ("r0", "r1"):
        rounds = summary["rounds"][region]
        assert [r["outer_step"] for r in rounds] == [0, 1, 2, 3]
        assert rounds[-1]["group_size"] == 2 and rounds[-1]["peers"] == ["r0", "r1"]
        # A round without r2 waits for it at most the matchmaking window (+ the all-reduce itself).
        assert max(r["seconds"] for r in rounds) < matchmaking + 20, rounds
    for step in range(4):
        assert summary["rounds"]["r0"][step]["digest"] == summary["rounds"]["r1"][step]["digest"]
    assert set(summary["global_digest"]) == {"r0", "r1"} and summary["regions_agree"]
    assert summary["eval_loss"] == summary["eval_loss"] and summary["eval_loss"] < summary["eval_loss_at_start"]


def test_a_region_joining_after_outer_step_2_starts_from_the_peers_state(local_ray, tmp_path):
    cfg = small_run(tmp_path / "first", "join", workers=[1, 1], inner_steps=3, outer_steps=10,
                    matchmaking_seconds=20.0)
    run = RunInThread(lambda: run_training(cfg))
    first = wait_for(lambda: sync_actor(cfg, "r0"), 180, "r0's SyncActor")
    wait_for(lambda: ray.get(first.outer_step.remote()) >= 2, 400, "outer step 2")
    # The joiner is configured as a run of its own (as from another Ray cluster) that knows one peer.
    joiner_cfg = dataclasses.replace(
        cfg, regions=[RegionConfig(name="r2", workers=1)],
        outer=dataclasses.replace(cfg.outer, initial_peers=ray.get(first.multiaddrs.remote())),
        run=dataclasses.replace(cfg.run, output_dir=str(tmp_path / "joiner")))
    joined = RunInThread(lambda: run_training(joiner_cfg))

    summary, joiner = run.join(timeout=900), joined.join(timeout=900)
    joins = [e for e in joiner["events"] if e["event"] == "region_joined"]
    assert len(joins) == 1 and joins[0]["to_step"] >= 2, joiner["events"]
    # It started from exactly the θ_global the others held after that outer step.
    assert joins[0]["digest"] == summary["rounds"]["r0"][joins[0]["to_step"] - 1]["digest"]
    # The last round included it, and all three regions end bit-identical.
    assert summary["rounds"]["r0"][-1]["group_size"] == 3, summary["rounds"]["r0"]
    assert sorted(summary["rounds"]["r0"][-1]["peers"]) == ["r0", "r1", "r2"]
    assert joiner["global_digest"]["r2"] == summary["global_digest"]["r0"] == summary["global_digest"]["r1"]


def test_a_stopped_run_resumes_from_its_outer_checkpoints_and_exports(local_ray, tmp_path):
    cfg = small_run(tmp_path, "resume", workers=[1, 1], inner_steps=2, outer_steps=2, checkpoint_every=1)
    first = run_training(cfg)
    resumed_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, outer_steps=3, resume=True))
    resumed = run_training(resumed_cfg)
    resumes = [e for e in resumed["events"] if e["event"] == "resumed"]
    # Both regions continue from exactly the θ_global the stopped run ended with, at outer step 2.
    assert sorted(e["region"] for e in resumes) == ["r0", "r1"]
    assert {e["digest"] for e in resumes} == {first["global_digest"]["r0"]}
    assert {e["outer_step"] for e in resumes} == {2}
    for region in ("r0", "r1"):
        assert [r["outer_step"] for r in resumed["rounds"][region]] == [2]
    assert resumed["regions_agree"]

    from transformers import AutoModelForCausalLM

    from ray_diloco.checkpoint import checkpoint_dir, load_outer_checkpoint
    from ray_diloco.cli import main

    region_dir = checkpoint_dir(tmp_path / "resume", "r0")
    assert main(["export", "--checkpoint", str(region_dir), "--out", str(tmp_path / "hf")]) == 0
    step, theta, _ = load_outer_checkpoint(region_dir / "outer-000003")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert step == 3
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), theta[name]), name
