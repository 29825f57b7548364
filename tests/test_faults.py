"""Fault injection on real processes (kill by PID, `ray.kill`) and regions joining mid-run.

- A worker killed inside a region: the region's Ray Train group restarts (FailureConfig), its new workers
  load θ_global from the region's SyncActor (which kept the outer state) and the run finishes.
- One of three regions killed: the other two reach every outer step, agree bit for bit, and no round
  waits longer than the killed region's record lives; in the same run, a region of another cluster (a driver with
  a Ray of its own) joining after outer step 2 loads θ_global from its peers over Hivemind (bit-identical) and takes
  part in the following rounds.
- A whole run killed after a checkpoint resumes to the model of a run that was never stopped, round by round,
  and every kept outer checkpoint names a complete worker checkpoint.
- A step saved again after a restart keeps its worker checkpoint (Ray Train's own retention deleted it).
- A group restarted after the round that stopped its region (the real worker loop: tests/test_stop.py has the
  SyncActor's side) writes the stop's checkpoint and ends without training.
- A driver's first SyncActor failing to start fails the others started beside it, with its own error.
"""

import dataclasses
import glob
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import ray
import torch

from conftest import Driver, RunInThread, assert_gone, driver_env, run_process_ids, small_run, wait_for
from leftovers import command_line, descendants
from ray_diloco.checkpoint import CheckpointStore, join
from ray_diloco.cli import main
from ray_diloco.config import RegionConfig
from ray_diloco.driver import run_training


def fit_releasing_the_controller(trainer):
    """`trainer.fit()` on this (the main) thread, where Ray Train installs a SIGINT handler that holds the run's
    TrainController; the old handler is put back, so the controller ends with its run. Held, it lived on to the end
    of the module's Ray, and once outlived the leftover check's 30 s there (CI: the saved-again test's last run).
    `ray-diloco train` runs each fit in a thread of its own, where Ray Train installs none."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        return trainer.fit()
    finally:
        signal.signal(signal.SIGINT, handler)


def sync_actor(cfg, region):
    return ray.get_actor(f"diloco-sync-{cfg.run.name}-{region}")


def test_worker_killed_inside_a_region_restarts_and_the_run_finishes(local_ray, tmp_path):
    cfg = small_run(tmp_path, "kill-worker", workers=[1, 2], inner_steps=3, outer_steps=3,
                    matchmaking_seconds=90.0, max_failures=1)
    run = RunInThread(lambda stop: run_training(cfg, stop=stop))
    actor = wait_for(lambda: sync_actor(cfg, "r1"), 180, "r1's SyncActor")
    wait_for(lambda: ray.get(actor.outer_step.remote()) >= 1, 300, "r1's first outer step")
    pids = ray.get(actor.worker_pids.remote())
    os.kill(pids[1], signal.SIGKILL)  # rank 1 of the 2-worker region, between outer steps 1 and 3

    summary = run.join(timeout=600)
    restarts = [e for e in summary["events"] if e["event"] == "worker_restart"]
    assert restarts and {e["region"] for e in restarts} == {"r1"}, summary["events"]
    for region in ("r0", "r1"):
        assert [r["outer_step"] for r in summary["rounds"][region]] == [0, 1, 2]
    # The restarted workers went on from the data position of the last outer step: every window once.
    windows_per_worker = 3 * 3 * cfg.inner.grad_accum * cfg.data.batch_size
    assert summary["data_fingerprint"]["r1"]["windows"] == 2 * windows_per_worker, summary["data_fingerprint"]
    assert summary["regions_agree"], summary["global_digest"]
    assert summary["eval_loss"] < summary["eval_loss_at_start"]


def test_a_region_killed_and_another_joining_later_the_run_finishes_with_every_live_region(local_ray, tmp_path):
    """Regions come and go in one run (one run for both: each costs minutes of CI). Of three regions, r2 is killed
    after outer step 1: r0 and r1 finish every outer step (from the join on, one may be re-synced past: see below),
    agree bit for bit, no round waits longer than r2's record lives, and no process of the run outlives it. After
    outer step 2 a region r3 joins from another cluster: `ray-diloco train` in a process of its own with a private
    Ray, configured as a run of its own that knows one peer (no shared Ray, clock source or lifetime with the
    others). It loads θ_global from its peers over Hivemind (bit-identical) and takes part in the following
    rounds."""
    # steps: the run still going when the joiner has started (a minute or more; rounds of 2-12 s meanwhile: in a CI
    # run it joined at step 7 of 12)
    matchmaking, steps = 15.0, 14
    cfg = small_run(tmp_path / "first", "come-and-go", workers=[1, 1, 1], inner_steps=3, outer_steps=steps,
                    matchmaking_seconds=matchmaking, max_failures=0)
    run = RunInThread(lambda stop: run_training(cfg, stop=stop))
    victim = wait_for(lambda: sync_actor(cfg, "r2"), 180, "r2's SyncActor")
    wait_for(lambda: ray.get(victim.outer_step.remote()) >= 1, 300, "r2's first outer step")
    run_pids = run_process_ids(cfg.run.name, ["r0", "r1", "r2"])
    pids = ray.get(victim.worker_pids.remote())
    ray.kill(victim)  # the region vanishes: its SyncActor and its worker
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)

    first = sync_actor(cfg, "r0")
    wait_for(lambda: ray.get(first.outer_step.remote()) >= 2, 400, "outer step 2")
    joiner_cfg = dataclasses.replace(
        cfg, regions=[RegionConfig(name="r3", workers=1)],
        outer=dataclasses.replace(cfg.outer, initial_peers=ray.get(first.multiaddrs.remote())),
        run=dataclasses.replace(cfg.run, output_dir=str(tmp_path / "joiner"), max_failures=1))  # the default
    joiner_config = tmp_path / "joiner.yaml"
    joiner_config.write_text(joiner_cfg.to_yaml())
    joined = Driver(["--config", str(joiner_config)], driver_env())
    try:
        summary = run.join(timeout=900)
        assert joined.process.wait(timeout=600) == 0, "r3's driver failed:\n" + joined.output()[-3000:]
    finally:
        joined.end()
    # a driver that joins a run started elsewhere (initial peers) names its files after its regions
    joiner = json.loads((tmp_path / "joiner" / cfg.run.name / "summary-r3.json").read_text())

    assert_gone(run_pids)  # a run whose region failed leaves no process behind either
    assert [e["region"] for e in summary["events"] if e["event"] == "region_departed"] == ["r2"]
    # r3 takes the run's state as its SyncActor starts, and again where the others moved on before its workers
    # started (the driver's catch_up): with rounds of a few seconds they often do (a CI run: joined at 7, then 8).
    joins = [e for e in joiner["events"] if e["event"] == "region_joined"]
    assert joins and joins[0]["to_step"] >= 2, joiner["events"]
    assert [e["to_step"] for e in joins] == sorted({e["to_step"] for e in joins}), joins  # forward only
    joined_at = joins[0]["to_step"]
    digests, missed = {}, []
    for region in ("r0", "r1"):
        rounds = summary["rounds"][region]
        # Every outer step is a round of the region's, but one it re-synced past: from r3's join on, a DHT read
        # may miss r3's new record in one region and not in the other, which then runs without the one still
        # waiting for r3; that one adopts the newer state and averages its Δ in the next round (no round of its
        # own at that step; the states stay one). Seen once in CI (r1 re-synced past step 3, r3's join step).
        # Before the join, no round is missed.
        resynced = [step for e in summary["events"] if e["event"] == "resync" and e["region"] == region
                    for step in range(e["from_step"], e["to_step"])]
        assert sorted([r["outer_step"] for r in rounds] + resynced) == list(range(steps)), (rounds, resynced)
        assert all(step >= joined_at for step in resynced), resynced
        missed += resynced
        # A round without r2 waits for it at most until its record expires (ttl = 2·matchmaking + 10 s: it is
        # live but never ready), then averages with those ready (+ the all-reduce itself). From r3's join on, a
        # round may wait for r3's workers to start (up to outer.max_wait_seconds): not bounded here.
        before_join = [r for r in rounds if r["outer_step"] < joined_at]
        assert max(r["seconds"] for r in before_join) < 2 * matchmaking + 10 + 20, rounds
        # The last round had every live region.
        assert rounds[-1]["group_size"] == 3 and sorted(rounds[-1]["peers"]) == ["r0", "r1", "r3"], rounds
        digests[region] = {r["outer_step"]: r["digest"] for r in rounds}
    assert len(missed) <= 1, missed  # one race with the joiner's first record, not a region left behind
    for step in digests["r0"].keys() & digests["r1"].keys():
        assert digests["r0"][step] == digests["r1"][step], step
    assert summary["eval_loss"] == summary["eval_loss"] and summary["eval_loss"] < summary["eval_loss_at_start"]

    # Each state r3 took is exactly the θ_global the others held after that outer step; all three end bit-identical.
    for taken in joins:
        assert taken["digest"] in (digests["r0"].get(taken["to_step"] - 1), digests["r1"].get(taken["to_step"] - 1))
    assert set(summary["global_digest"]) == {"r0", "r1"} and summary["regions_agree"]
    assert joiner["global_digest"]["r3"] == summary["global_digest"]["r0"]


def test_a_killed_run_resumes_to_the_model_of_an_uninterrupted_run(local_ray, tmp_path):
    """Checkpoints every outer step; the whole run is killed (SyncActors and every worker, by PID) after a
    checkpoint; `--resume` continues from it. Same seeds → the same θ_global after every round, bit for bit, and the
    same windows trained on, none twice, none skipped, as the run that was never stopped."""
    def config(name):
        return small_run(tmp_path / name, name, workers=[2, 1], inner_steps=3, outer_steps=3, checkpoint_every=1,
                         max_failures=0)

    reference = run_training(config("straight"))

    cfg = config("stopped")
    run = RunInThread(lambda stop: run_training(cfg, stop=stop))
    stores = {r: CheckpointStore(join(cfg.run.checkpoint_root(), r)) for r in ("r0", "r1")}
    wait_for(lambda: all((s.latest_step() or 0) >= 1 for s in stores.values()), 400, "checkpoints of step 1")
    actors = [sync_actor(cfg, r) for r in ("r0", "r1")]
    pids = [pid for a in actors for pid in ray.get(a.worker_pids.remote()).values()]
    for actor in actors:
        ray.kill(actor)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="training failed"):
        run.join(timeout=300)
    stopped_at = min(s.latest_step() for s in stores.values())
    assert 1 <= stopped_at < 3, "the kill came after the run finished; test is void"

    resumed = run_training(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True)))
    events = resumed["events"]
    assert sorted(e["region"] for e in events if e["event"] == "resumed") == ["r0", "r1"]
    assert {e["outer_step"] for e in events if e["event"] == "resumed"} == {stopped_at}
    restored = [e for e in events if e["event"] == "inner_state_restored"]
    assert sorted(e["region"] for e in restored) == ["r0", "r1"], events  # AdamW state from the worker checkpoints
    for region in ("r0", "r1"):
        assert [r["outer_step"] for r in resumed["rounds"][region]] == list(range(stopped_at, 3))
    assert resumed["regions_agree"]
    # The same windows as the uninterrupted run: a window seen twice or skipped changes the fingerprint.
    assert resumed["data_fingerprint"] == reference["data_fingerprint"], (resumed["data_fingerprint"],
                                                                          reference["data_fingerprint"])
    # Every round from the resume on ends on the θ_global the uninterrupted run had after it, bit for bit (the
    # all-reduce is exact: hivemind_exact); where they part, the message says which round, who took part in it and
    # what the resumed run recorded.
    rounds = {name: {region: [(r["outer_step"], r["group_size"], r["digest"][:12]) for r in result["rounds"][region]]
                     for region in ("r0", "r1")} for name, result in (("straight", reference), ("resumed", resumed))}
    for region in ("r0", "r1"):
        assert rounds["resumed"][region] == rounds["straight"][region][stopped_at:], (stopped_at, rounds, events)
    straight_model = load_model(tmp_path / "straight" / "straight" / "model")
    resumed_model = load_model(tmp_path / "stopped" / "stopped" / "model")
    for name, param in straight_model.items():
        torch.testing.assert_close(resumed_model[name], param, rtol=0, atol=0, msg=name)
    # Every kept outer checkpoint names a complete worker checkpoint (the killed run's saves of the same steps
    # are other directories: each save has its own).
    for region, store in stores.items():
        named = [Path(store.load(step).worker_checkpoint) for step in store.steps()]
        assert len(set(named)) == 2 and all((path / "meta.json").is_file() for path in named), (region, named)

    # The latest outer checkpoint exports as a Hugging Face model: θ_global of the last outer step.
    assert main(["export", "--checkpoint", str(stores["r0"].root), "--out", str(tmp_path / "hf")]) == 0
    exported = load_model(tmp_path / "hf")
    for name, param in resumed_model.items():
        assert torch.equal(exported[name], param), name


def load_model(directory):
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(str(directory)).named_parameters())


def test_a_step_saved_again_after_a_restart_keeps_its_worker_checkpoint(local_ray, tmp_path):
    """Ray Train keeps its list of reported checkpoints across a run's restarts (same name and storage). A run
    resumed from outer step 1 trains and saves step 2 again: that save must survive the next one, since the
    SyncActor's kept outer checkpoint names it. With one directory name per step and Ray Train's `num_to_keep=2`,
    the report of step 3 deleted step 2's directory (the first save's entry pointed at the same path). The last run
    saves enough that Ray Train deletes the first save of step 2 whatever `num_to_keep` is now."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_diloco.driver import worker_checkpoint_config
    from ray_diloco.lifecycle import abort_training_controllers
    from ray_diloco.worker_checkpoint import load_worker_checkpoint

    storage, saved = tmp_path / "storage", tmp_path / "saved.txt"

    def loop(config):
        from ray_diloco.worker_checkpoint import save_worker_checkpoint

        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        for step in config["steps"]:
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            location = save_worker_checkpoint(model, optimizer, config["experiment"], step, 3 * step, 0, 1)
            with open(config["saved"], "a") as handle:
                handle.write(f"{step} {location}\n")

    def run(steps):
        fit_releasing_the_controller(TorchTrainer(
            loop, train_loop_config={"steps": steps, "experiment": str(storage / "exp"), "saved": str(saved)},
            scaling_config=ScalingConfig(num_workers=1),
            run_config=RunConfig(name="exp", storage_path=str(storage), checkpoint_config=worker_checkpoint_config())))

    run([1, 2])
    run([2, 3])  # resumed from step 1: step 2 trained and saved again
    keep = worker_checkpoint_config().num_to_keep
    later = list(range(4, 4 + keep - 2))  # the second save of step 2 the oldest of the last `keep` saves
    run(later)  # and again: Ray Train deletes the two oldest saves itself, the first of step 2 the second of them
    controllers = lambda: [pid for pid in descendants(os.getpid())  # noqa: E731
                           if command_line(pid).startswith("ray::TrainController")]
    try:
        wait_for(lambda: not controllers(), 60, "the runs' TrainControllers to end with their runs")
    except AssertionError:  # CI: Ray's PlacementGroupCleaner did not stop within its timeout and held one for good
        print(f"TrainController(s) {controllers()} outlived their runs by 60 s; killed", file=sys.stderr)
        abort_training_controllers()
        wait_for(lambda: not controllers(), 30, "the killed TrainControllers to end")
    saves = [line.split() for line in saved.read_text().splitlines()]
    assert [int(step) for step, _ in saves] == [1, 2, 2, 3, *later]
    left = sorted(path.name for path in (storage / "exp").glob("checkpoint-outer-*"))
    assert left == sorted(location.rsplit("/", 1)[1] for _, location in saves[-keep:])  # the newest saves
    for step, location in saves[-keep:]:  # the second save of step 2 among them, whole
        model = torch.nn.Linear(4, 4)
        assert load_worker_checkpoint(location, model, torch.optim.AdamW(model.parameters()))["outer_step"] == int(step)


def test_a_real_group_restarted_after_its_regions_stop_checkpoints_that_step_and_trains_nothing(local_ray, tmp_path):
    """The worker side of the restart above, with real parts: the region's SyncActor, data stream and Ray Train
    group (FSDP2 over gloo) as the driver starts them. The first group's two rounds are handed in by this test; the
    stop reaches the SyncActor before the second, and the group dies before it checkpoints (nothing is committed:
    run.checkpoint_every 0 checkpoints only where the run stops). The group Ray Train starts in its place
    (`region_train_loop`) writes the stop's checkpoint, of θ_global at the stop's step, and ends without training;
    a group restarted once more finds that checkpoint committed and writes nothing. That checkpoint's AdamW state is
    the new group's, which trained no step: a group that loads it says `inner_state_reset`, not restored (it
    said restored before the checkpoint was marked fresh)."""
    from ray_diloco.actor_by_name import ActorByName
    from ray_diloco.data import DataCounters
    from ray_diloco.driver import dataset_recipes, make_trainer, start_streams, start_sync_actors
    from ray_diloco.lifecycle import release_all, wait_until_dead
    from ray_diloco.run_setup import resolve_vocab
    from ray_diloco.sharding import from_wire, to_wire
    from ray_diloco.sync.outer import state_digest
    from ray_diloco.tokenizer import load_tokenizer

    cfg = small_run(tmp_path, "real-restart-after-stop", [1], outer_steps=4, checkpoint_every=0,
                    checkpoint_path=str(tmp_path / "bucket"))
    cfg = resolve_vocab(cfg, load_tokenizer(cfg.data.tokenizer))  # as the driver does: the model's true shapes
    started = list(start_sync_actors(cfg, {"r0": None}))
    actor = started[0]
    try:
        started.append(DataCounters.options(name="restart-after-stop-counters").remote())  # the streams count here
        by_name = ActorByName("restart-after-stop-counters")
        started += start_streams(cfg, cfg.regions, dataset_recipes(cfg, cfg.regions, by_name), by_name)
        theta = ray.get(actor.global_state.remote())
        for step in range(2):  # the first group's windows: θ_global moved a little, as H inner steps would
            if step == 1:
                ray.get(actor.request_stop.remote())  # `ray job stop`, before the second hand-in
            shards = to_wire({name: t + 1e-3 * (step + 1) for name, t in theta.items()})
            tokens = cfg.tokens_per_worker(1)  # a whole window's (a weight above the run's bound is refused)
            reached, rows, stop = ray.get(actor.exchange.remote(step, 0, 1, shards, tokens))
            theta = from_wire(rows)
        assert (reached, stop) == (2, True)
        store = CheckpointStore(join(cfg.run.checkpoint_root(), "r0"))
        assert store.steps() == []  # the first group died before its checkpoint

        restarted = fit_releasing_the_controller(make_trainer(cfg, cfg.regions[0], None))
        assert restarted.error is None, restarted.error
        worker = restarted.return_value
        assert (worker["stopped"], worker["outer_step"], worker["tokens_per_worker"]) == (True, 2, 0), worker
        assert store.steps() == [2]
        committed = store.load(2)
        assert state_digest(committed.theta) == state_digest(theta) == ray.get(actor.digest.remote())
        events = [e["event"] for e in ray.get(actor.stats.remote())["events"]]
        assert events.count("inner_state_reset") == 1 and "inner_state_restored" not in events, events
        again = fit_releasing_the_controller(make_trainer(cfg, cfg.regions[0], None))
        assert again.error is None and again.return_value["stopped"] and again.return_value["outer_step"] == 2
        assert store.steps() == [2] and store.load(2).worker_checkpoint == committed.worker_checkpoint

        def inner_state_events():  # sent by the worker without waiting for them: they may arrive a moment later
            return [e for e in ray.get(actor.stats.remote())["events"] if e["event"].startswith("inner_state_")]

        events = wait_for(lambda: len(inner_state_events()) == 2 and inner_state_events(), 30, "the second event")
        assert [(e["event"], e["checkpoint"]) for e in events] == [
            ("inner_state_reset", None), ("inner_state_reset", committed.worker_checkpoint)], events
    finally:  # as the driver ends them: each closes its own processes (Hivemind's, Ray Data's), then is killed
        release_all([(actor, "shutdown"), *((a, None) for a in started[1:2]), *((s, "close") for s in started[2:])])
        assert not wait_until_dead(started)


def test_the_first_regions_actor_failing_to_start_fails_the_start_with_its_own_error(local_ray, tmp_path):
    """A driver's SyncActors start side by side, each after the first waiting for the first's multiaddrs
    (`peers_from`): where the first cannot start (here: told to resume from a checkpoint that is not there), the
    others fail with it, and the driver's start raises the first's own error, not a hang."""
    from ray_diloco.driver import start_sync_actors

    cfg = actor_start_config(tmp_path, "first-fails")
    before = hivemind_sockets()
    with pytest.raises(Exception, match="no committed outer checkpoint of step 2"):
        start_sync_actors(cfg, {"r0": 2, "r1": None})
    # r0's Hivemind had started: Ray calls no shutdown on an actor whose constructor raised, the actor does
    wait_for(lambda: not hivemind_sockets() - before, 30, "the failed actor's Hivemind socket files removed")


def test_a_later_regions_actor_failing_to_start_ends_the_actors_already_started(local_ray, tmp_path):
    """Where the second region's actor cannot start, the first — started, its Hivemind running — is ended with
    its processes before the error reaches the caller: a driver in a process that lives on (a notebook, a test
    session, a service) is left with no actor of the failed run (one was found alive by name a minute later)."""
    from ray_diloco.driver import run_actor_name, start_sync_actors

    cfg = actor_start_config(tmp_path, "second-fails")
    before = hivemind_sockets()
    with pytest.raises(Exception, match="no committed outer checkpoint of step 2"):
        start_sync_actors(cfg, {"r0": None, "r1": 2})
    with pytest.raises(ValueError):  # Ray knows no live actor by that name
        ray.get_actor(run_actor_name("sync", cfg, "r0"))
    wait_for(lambda: not hivemind_sockets() - before, 30, "both actors' Hivemind socket files removed")


def hivemind_sockets() -> set[str]:
    """The unix sockets of Hivemind's p2p daemons and clients on this host (each one's own: a random name)."""
    return set(glob.glob("/tmp/hivemind-*.sock"))


def actor_start_config(tmp_path, name):
    """A two-region run's config with the model's true shapes, as the driver has it when it starts the actors."""
    from ray_diloco.run_setup import resolve_vocab
    from ray_diloco.tokenizer import load_tokenizer

    cfg = small_run(tmp_path, name, [1, 1], checkpoint_path=str(tmp_path / "bucket"))
    return resolve_vocab(cfg, load_tokenizer(cfg.data.tokenizer))


def test_a_regions_unreadable_data_ends_the_streams_already_started(local_ray, tmp_path):
    """`start_streams` fails the run on a region's unreadable data before training: the other region's stream,
    already started, is ended before the error reaches the caller (the caller holds no handle to end it by)."""
    from ray_diloco.driver import run_actor_name, start_streams

    def no_dataset():  # defined here: Ray's workers cannot import this test module (pickled by value)
        raise FileNotFoundError("no data under s3://nowhere/c4 (as a region's unreadable data)")

    cfg = small_run(tmp_path, "stream-fails", [1, 1])
    with pytest.raises(Exception, match="no data under s3://nowhere"):
        start_streams(cfg, cfg.regions, [lambda: ray.data.range(8), no_dataset], None)
    for region in ("r0", "r1"):  # the started one, and the one whose data failed (alive until ended)
        with pytest.raises(ValueError):  # Ray knows no live actor by that name
            ray.get_actor(run_actor_name("stream", cfg, region))
