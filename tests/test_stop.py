"""The stop path, as `ray job stop` and Ctrl-C reach it: a signal to the driver process.

- `RunStop` by phase: a stop during start-up ends the run before training; during training the first signal is
  forwarded and the deadline counts from it, a second one forces; after training a signal changes nothing.
- Stop settings that cannot hold are refused before Ray starts, naming the fields (and RAY_JOB_STOP_WAIT_TIME_S).
- Two regions of one driver (real SyncActors and Hivemind in this process): a stop request that reached one
  region before its round and the other only after it ends both at that round's outer step, with one state;
  with outer.overlap the other's workers, a window ahead, end at that step too.
- Real processes (`ray-diloco train` with a private Ray): a region that never reaches an outer-step boundary is
  aborted once run.stop_timeout_seconds has passed: the driver ends within seconds of it, names what it stopped
  and what was last checkpointed, writes `stopped: true` for the region that stopped cleanly, and leaves no
  process behind. A SIGTERM during start-up ends the driver in one line, with nothing left running either.
"""

import asyncio
import json
import os
import signal
import time

import pytest
import yaml

from conftest import TEST_DATA, Driver, RunInThread, assert_gone, driver_env, wait_for
from ray_diloco.cli import main
from ray_diloco.config import ConfigError, ExperimentConfig
from ray_diloco.sharding import from_wire
from ray_diloco.stopping import RunStop, RunStopped
from ray_diloco.sync.actor import SyncActorImpl
from ray_diloco.sync.outer import state_digest
from ray_diloco.worker import SLOW_REGION_ENV_VAR
from test_sync_actor import config, trained


def test_a_stop_during_start_up_ends_the_run_there_before_training():
    with RunStop(timeout=5) as stop:
        with pytest.raises(RunStopped, match="before training started"):
            os.kill(os.getpid(), signal.SIGTERM)  # raised by the handler, in the main thread, at once
            time.sleep(5)
        with pytest.raises(RunStopped):  # and any later start-up step refuses to go on
            stop.start_training([])


def test_during_training_the_deadline_counts_from_the_first_signal_and_a_second_forces():
    with RunStop(timeout=0.5) as stop:
        stop.start_training([object()])  # a SyncActor stand-in (its request_stop cannot be called: logged)
        assert not stop.deadline_passed()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert stop.requested.is_set() and not stop.deadline_passed()
        time.sleep(0.6)
        assert stop.deadline_passed() and not stop.forced
    with RunStop(timeout=60) as stop:
        stop.start_training([object()])
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert stop.forced and stop.deadline_passed()


def test_a_baseline_run_has_no_boundary_to_wait_for_and_stops_at_once(capsys):
    with RunStop(timeout=900) as stop:
        stop.start_training([None])  # ddp / single: no SyncActor
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert stop.deadline_passed()
    assert "no outer step to stop at: stopping now" in capsys.readouterr().out


def test_a_run_a_test_leaves_in_a_thread_is_aborted_from_another_thread_and_waited_for():
    """`RunStop.abort` works from any thread: conftest.RunInThread.end (the teardown of a test that failed before
    joining its run) aborts a driver waiting in training, as the driver's wait loop sees it, and waits for it."""
    seen = []

    def driver(stop):  # what the driver's wait does while its groups train: look at the deadline
        stop.start_training([None])
        while not stop.deadline_passed():
            time.sleep(0.05)
        seen.append(stop.forced)

    run = RunInThread(driver)
    assert run in RunInThread.left
    wait_for(lambda: run.stop.phase == "training", 10, "the driver in training")
    assert run.end(timeout=10) is None
    assert not run.thread.is_alive() and seen == [True] and run not in RunInThread.left


def test_after_training_a_signal_lets_the_driver_finish(capsys):
    before = signal.getsignal(signal.SIGTERM)
    with RunStop(timeout=60) as stop:
        stop.start_training([object()])
        stop.finish()
        os.kill(os.getpid(), signal.SIGTERM)  # would kill pytest were it not handled
        time.sleep(0.1)
        assert not stop.requested.is_set() and not stop.deadline_passed()
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    assert "finishing the evaluation, export and summary" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back


def test_a_stop_timeout_shorter_than_one_rounds_waits_is_refused_naming_the_fields():
    with pytest.raises(ConfigError, match=r"^run.stop_timeout_seconds: 100 s cannot hold .*outer.max_wait_seconds "
                                          r"\+ outer.averaging_timeout\) = 420 s"):
        ExperimentConfig.from_yaml("run: {stop_timeout_seconds: 100}")
    with pytest.raises(ConfigError, match=r"two rounds.* = 840 s"):  # overlap: the round in flight, then the stop's
        ExperimentConfig.from_yaml("outer: {overlap: true}\nrun: {stop_timeout_seconds: 600}")
    two = "regions: [{name: a, workers: 1}, {name: b, workers: 1}]\n"
    with pytest.raises(ConfigError, match=r"an all-reduce in progress, then one round's .* = 540 s"):
        ExperimentConfig.from_yaml(two + "run: {stop_timeout_seconds: 500}")  # a request mid-round ends the next
    ExperimentConfig.from_yaml(two + "run: {stop_timeout_seconds: 500, local_regions: [a]}")  # alone in its driver
    for preset in ("tiny-cpu", "150m", "1b"):  # the defaults hold
        assert main(["config", "--preset", preset]) == 0


def test_a_job_stop_wait_shorter_than_the_stop_is_refused_before_ray_starts(monkeypatch, capsys):
    monkeypatch.setenv("RAY_JOB_STOP_WAIT_TIME_S", "360")
    started = time.monotonic()
    assert main(["train", "--run-name", "short-wait"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and time.monotonic() - started < 10
    assert err.startswith("ray-diloco: error: RAY_JOB_STOP_WAIT_TIME_S=360 is shorter than "
                          "run.stop_timeout_seconds (900) + 120 s"), err
    monkeypatch.delenv("RAY_JOB_STOP_WAIT_TIME_S")  # inside a Ray job, unset means Ray's 3 s
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    assert main(["train", "--run-name", "short-wait"]) == 2
    assert "RAY_JOB_STOP_WAIT_TIME_S=3 (Ray's default: not set)" in capsys.readouterr().err
    monkeypatch.setenv("RAY_JOB_STOP_WAIT_TIME_S", "3720.0")  # Ray's int() would fail on it at stop time
    assert main(["train", "--run-name", "short-wait"]) == 2
    assert "not a whole number of seconds" in capsys.readouterr().err


def test_a_region_that_never_reaches_a_boundary_is_aborted_at_the_stop_timeout(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "outer": {"inner_steps": 3, "max_wait_seconds": 2, "matchmaking_seconds": 1, "averaging_timeout": 3},
        "run": {"stop_timeout_seconds": 20, "outer_steps": 50, "checkpoint_every": 1},
        "inner": {"warmup_steps": 2}, "data": TEST_DATA}))
    driver = Driver(["--config", str(config), "--regions", "2", "--run-name", "aborted", "--output-dir",
                     str(tmp_path)], driver_env(**{SLOW_REGION_ENV_VAR: "region-b:600"}))  # b never gets past step 3
    # Generous: a loaded CI machine took over 240 s to start both regions' workers here.
    driver.wait_for_line("[region-a] outer step 1/50 synced", timeout=480)
    started = driver.stop()
    stopped_at = time.monotonic()
    code = driver.process.wait(timeout=120)
    took = time.monotonic() - stopped_at
    out = driver.output()
    assert code == 0, out[-3000:]
    assert took < 20 + 40, f"the driver took {took:.0f}s after SIGTERM with a 20 s stop timeout"
    assert "no outer-step boundary within 20 s; aborting the training of ['region-b']" in out, out[-3000:]
    assert "Traceback" not in out.split("SIGTERM: stopping at the end")[-1], out[-3000:]
    # Ray's warning for a blocking wait on an async actor's event loop (the SyncActor's constructor waiting for
    # the first region's addresses) is not among the lines a run prints.
    assert "Using blocking ray.get inside async actor" not in out, out[-3000:]
    checkpoints = [line for line in out.splitlines() if "last committed checkpoints" in line]
    assert checkpoints and "region-b: none" in checkpoints[-1] and "region-a: outer step" in checkpoints[-1]
    summary = json.loads((tmp_path / "aborted" / "summary.json").read_text())
    assert summary["stopped"] and [r["name"] for r in summary["regions"]] == ["region-a", "region-b"]
    assert [e["region"] for e in summary["events"] if e["event"] == "region_aborted"] == ["region-b"]
    assert (tmp_path / "aborted" / "model" / "config.json").is_file()  # the export finished
    assert_gone(started)


def test_a_sigterm_during_start_up_ends_the_driver_in_one_line_leaving_nothing(tmp_path):
    driver = Driver(["--run-name", "early", "--output-dir", str(tmp_path)], driver_env())
    driver.wait_for_line("[driver] started a private local Ray", timeout=120)
    started = driver.stop()
    code = driver.process.wait(timeout=60)
    out = driver.output()
    assert code == 0 and "Traceback" not in out, out[-3000:]
    assert "[driver] stopped on request before training started" in out, out[-3000:]  # the CLI's one line
    assert not (tmp_path / "early" / "summary.json").exists()
    assert_gone(started)


def two_regions_of_one_driver(tmp_path, overlap: bool) -> list[SyncActorImpl]:
    cfg = config(tmp_path, "agreed-stop", [1, 1], outer_steps=4, matchmaking_seconds=5.0)
    cfg["outer"]["overlap"] = overlap
    first = SyncActorImpl(cfg, "r0")
    try:
        return [first, SyncActorImpl(cfg, "r1", initial_peers=first.multiaddrs())]
    except BaseException:
        first.shutdown()
        raise


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_a_stop_that_reached_one_region_of_a_driver_before_the_round_ends_both_at_its_step(tmp_path, overlap):
    """`ray job stop`: the driver forwards the request to each of its SyncActors; here r0 has it when it hands in
    its round, r1 only after the round (the order the two deliveries may take on a loaded machine). Before the
    round's agreement (policy.stops_after_round), r0 ended at step 1 and r1 trained on to a round alone, after
    waiting outer.max_wait_seconds for r0, and checkpointed another step: a resubmit no longer continued to the
    model of an uninterrupted run (a CI failure of test_job_submit)."""
    r0, r1 = two_regions_of_one_driver(tmp_path, overlap)
    try:
        async def stop_reaching_r0_first():
            r0.request_stop()
            first = await asyncio.gather(r0.exchange(0, 0, 1, trained(r0, 1), tokens=1000),
                                         r1.exchange(0, 0, 1, trained(r1, 2), tokens=1000))
            r1.request_stop()  # its delivery, after the round
            if overlap:
                # r0 blocked on the round (it was stopping); r1's ran in the background while its workers trained
                # on: they hand in the next window, and end at the step the round agreed on.
                first = [first[0], await r1.exchange(1, 0, 1, trained(r1, 3), tokens=1000)]
            # A group restarted now (a worker died as they checkpointed) ends at that step too, without training.
            return first, [await actor.resume_state(0, 1) for actor in (r0, r1)]

        ((step0, rows0, stop0), (step1, rows1, stop1)), restarted = asyncio.run(stop_reaching_r0_first())
    finally:
        for actor in (r1, r0):
            actor.shutdown()
    assert stop0 and stop1, (stop0, stop1)
    assert [(point["outer_step"], point["stop"]) for point in restarted] == [(1, True), (1, True)]
    assert step0 == step1 == 1 == r0.outer_step() == r1.outer_step()
    assert r0.last_round()["group_size"] == r1.last_round()["group_size"] == 2
    assert state_digest(from_wire(rows0)) == state_digest(from_wire(rows1)) == r0.digest() == r1.digest()


def test_a_group_restarted_after_the_round_that_stopped_its_region_ends_at_that_step(tmp_path):
    """A worker that dies after the round that told its region to stop (while the workers checkpoint, or end)
    restarts the region's group. The new group used to train a window: a region alone in its driver then ran one
    more round and stopped a step later than asked (in a multi-region driver, `Rounds._stopped_in_flight` ended
    that window unaveraged). `resume_state` says where the region stopped; a restart before the stop did not."""
    actor = SyncActorImpl(config(tmp_path, "restart-after-stop", [1], outer_steps=4), "r0")
    try:
        async def stop_then_restart():
            first = await actor.exchange(0, 0, 1, trained(actor, 1), tokens=1000)
            before_stop = await actor.resume_state(0, 1)  # a restart with no stop asked: the group trains on
            actor.request_stop()
            stopping = await actor.exchange(1, 0, 1, trained(actor, 2), tokens=1000)
            return first, before_stop, stopping, await actor.resume_state(0, 1)

        first, before_stop, stopping, restarted = asyncio.run(stop_then_restart())
    finally:
        actor.shutdown()
    assert (first[0], first[2]) == (1, False) and (before_stop["outer_step"], before_stop["stop"]) == (1, False)
    assert (stopping[0], stopping[2]) == (2, True)
    assert (restarted["outer_step"], restarted["stop"]) == (2, True) and actor.outer_step() == 2


def test_a_request_that_came_after_the_hand_in_does_not_stop_a_restarted_group_of_a_multi_region_driver(tmp_path):
    """Two regions of one driver: a request that reaches both after they handed in ends the next round, not this
    one. A group restarted in between trains on (`resume_state` says stop only where a round agreed to)."""
    r0, r1 = two_regions_of_one_driver(tmp_path, overlap=False)
    try:
        async def round_then_requests():
            done = await asyncio.gather(r0.exchange(0, 0, 1, trained(r0, 1), tokens=1000),
                                        r1.exchange(0, 0, 1, trained(r1, 2), tokens=1000))
            for actor in (r0, r1):
                actor.request_stop()
            return done, [await actor.resume_state(0, 1) for actor in (r0, r1)]

        done, restarted = asyncio.run(round_then_requests())
    finally:
        for actor in (r1, r0):
            actor.shutdown()
    assert [(step, stop) for step, _, stop in done] == [(1, False), (1, False)]
    assert [(point["outer_step"], point["stop"]) for point in restarted] == [(1, False), (1, False)]
