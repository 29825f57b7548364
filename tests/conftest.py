"""Shared fixtures: one local Ray cluster per test module that needs it, and small run configs."""

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import ray

import leftovers
from leftovers import descendants

from ray_diloco.config import RegionConfig
from ray_diloco.presets import tiny_cpu
from ray_diloco.sync.parent_bound import alive

RAY = str(Path(sys.executable).with_name("ray"))  # the `ray` command of this environment

# An averager's process forks from the pytest process, and pytest's log capture stays behind in each child: its
# records were lost. Its warnings (a failed all-reduce says how far each stream got) go to stderr instead, so a failing
# test's captured output shows them.
class _ToCurrentStderr(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record: pytest swaps it for each test's capture (capfd included)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


# The level on the handler, not the logger: tests that read the module's info records (caplog) still get them.
_to_stderr = _ToCurrentStderr()
_to_stderr.setLevel(logging.WARNING)
_to_stderr.setFormatter(logging.Formatter("%(levelname)s pid %(process)d %(name)s: %(message)s"))
for _name in ("ray_diloco.sync.hivemind_exact", "ray_diloco.sync.exact_allreduce"):
    logging.getLogger(_name).addHandler(_to_stderr)

# multiprocessing's resource tracker lives as long as pytest once a module spawns a process: started now, before any
# module's mark (tests/leftovers.py), so that no module is taken to have left it running.
resource_tracker.ensure_running()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_SESSION] = session  # its exitstatus is read last, after every plugin's sessionfinish


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with pytest's exit status once everything is reported, without the interpreter's finalization: a full
    run (417 passed) once ended in a segmentation fault there, after its summary, with no Python frame to show
    (a C extension's teardown — Ray, Hivemind, torch and pyarrow's S3 client all live in this process). The status
    is pytest's own, so a failing test still fails the run."""
    session = config.stash.get(_SESSION, None)
    if session is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(session.exitstatus))


_SESSION = pytest.StashKey[pytest.Session]()


@pytest.fixture(autouse=True, scope="module")
def no_ray_left_behind(request):
    """A module that leaves Ray initialized in this process fails here, by name: the next module's `ray.init`
    would fail, or a run would attach to the leftover Ray (CI saw both, after Ray Data auto-started one). So does
    a module that leaves a process of its own running (tests/leftovers.py: found by a mark in its environment,
    wherever it was re-parented to), after the processes of a cluster just shut down had time to exit."""
    mark, since = leftovers.mark_for(request.module.__name__), leftovers.clock_ticks_now()
    os.environ[leftovers.MARK] = mark  # inherited by every process the module starts
    yield
    initialized = ray.is_initialized()
    if initialized:
        ray.shutdown()
    left = leftovers.left_behind(mark, since, grace_seconds=30.0)
    os.environ.pop(leftovers.MARK, None)
    if initialized:
        pytest.fail(f"{request.module.__name__} left Ray initialized in the pytest process", pytrace=False)
    if left:
        listed = "; ".join(f"{pid}: {command}" for pid, command in sorted(left.items()))
        pytest.fail(f"{request.module.__name__} left {len(left)} process(es) running 30 s after its end "
                    f"(killed now): {listed}", pytrace=False)


@pytest.fixture
def draws_independent_of_loaded_modules(monkeypatch):
    """Hypothesis mixes constants from every loaded module of this project into its draws, so the derandomized
    search drew other schedules after another test file had imported more of ray_diloco: coverage paths were
    missed or reached depending on which tests ran first (a run after tests/test_stop.py missed the crashed
    region's replay). Without those constants the draws are the same whatever ran before. Where a Hypothesis
    version has no such hook, nothing changes."""
    from hypothesis.internal.conjecture import providers

    if not hasattr(providers, "_get_local_constants") or not hasattr(providers, "CONSTANTS_CACHE"):
        yield
        return
    empty = providers.Constants()
    monkeypatch.setattr(providers, "_get_local_constants", lambda: empty)
    providers.CONSTANTS_CACHE.cache.clear()
    yield
    providers.CONSTANTS_CACHE.cache.clear()


@pytest.fixture(scope="module")
def local_ray():
    # 8 logical CPUs on 2 cores: every worker and SyncActor gets a slot, they take turns on the cores.
    # address="local": our own cluster, even where `ray start` runs one on this machine.
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    yield
    ray.shutdown()


# What a test run trains on: 2 windows of 64 tokens a step (the tiny-cpu preset: 8 of 128) and 8 held-out windows (64).
# End-to-end tests are CPU-bound on 2 cores, and the tiny model's step is mostly its 50,257-token LM head, whose work
# is per token: 0.22 s a step instead of 1.6 s, 0.6 s an evaluation instead of 5 s (one thread, this machine).
TEST_DATA = {"seq_len": 64, "batch_size": 2, "eval_windows": 8}


def small_run(tmp_path, name, workers, inner_steps=4, outer_steps=3, matchmaking_seconds=30.0, data=TEST_DATA,
              **run_fields):
    """The tiny-cpu preset cut down to a test: regions r0, r1, … with the given worker counts, on TEST_DATA
    (`data={}`: the preset's, where a test's rounds declare tokens that many windows of the preset hold)."""
    cfg = tiny_cpu()
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, **data),
        regions=[RegionConfig(name=f"r{i}", workers=w) for i, w in enumerate(workers)],
        inner=dataclasses.replace(cfg.inner, warmup_steps=2),
        outer=dataclasses.replace(cfg.outer, inner_steps=inner_steps, matchmaking_seconds=matchmaking_seconds,
                                  averaging_timeout=max(120.0, 2 * matchmaking_seconds)),
        run=dataclasses.replace(cfg.run, name=name, outer_steps=outer_steps, output_dir=str(tmp_path), **run_fields),
    )


class RunInThread:
    """Runs a driver (`target(stop)`, e.g. `lambda stop: run_training(cfg, stop=stop)`) in a thread of the pytest
    process, so a test can inject faults while it trains. A run the test leaves behind (it failed before `join`) is
    aborted through its `RunStop` at the test's teardown (`end_runs_left_in_threads`), and waited for: a driver
    thread going on into the module's teardown would call Ray after `ray.shutdown()`, attach again to the stopped
    cluster, and Ray would end the whole pytest process without a word (it did so in CI, from tests/test_elastic.py
    when that test still ran its driver in a thread)."""

    left: list["RunInThread"] = []  # started and not joined yet

    def __init__(self, target):
        from ray_diloco.stopping import RunStop

        self.result, self.error = None, None
        self.stop = RunStop()  # never entered: no signal handlers (those belong to the main thread)
        self.thread = threading.Thread(target=self._run, args=(target,), daemon=True)
        RunInThread.left.append(self)
        self.thread.start()

    def _run(self, target):
        try:
            self.result = target(self.stop)
        except BaseException as error:  # re-raised in join()
            self.error = error

    def join(self, timeout):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"run did not finish within {timeout}s"
        RunInThread.left.remove(self)
        if self.error:
            raise self.error
        return self.result

    def end(self, timeout: float = 300) -> str | None:
        """Abort the run now (as a second Ctrl-C would) and wait for its thread and the `fit-<region>` threads it
        started (an abort gives them a grace period and returns without them). Returns what is still running
        after `timeout`, if anything. The driver's own error, other than the stop the abort caused, is printed:
        it is often why the test failed."""
        from ray_diloco.lifecycle import FIT_THREAD_PREFIX
        from ray_diloco.stopping import RunStopped

        deadline = time.monotonic() + timeout
        if self.thread.is_alive():
            self.stop.abort("the test ended before the run")
            self.thread.join(timeout)
        for thread in [t for t in threading.enumerate() if t.name.startswith(FIT_THREAD_PREFIX)]:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self in RunInThread.left:
            RunInThread.left.remove(self)
        if self.error is not None and not isinstance(self.error, RunStopped):
            print(f"the driver thread's error: {self.error!r}", file=sys.__stderr__, flush=True)
        left = [t.name for t in threading.enumerate() if t is self.thread or t.name.startswith(FIT_THREAD_PREFIX)]
        return f"{left} still running {timeout:.0f} s after the abort" if left else None


@pytest.fixture(autouse=True)
def end_runs_left_in_threads(request):
    """After each test, before any module fixture's teardown (`local_ray`'s `ray.shutdown()`): RunInThread.end.
    pytest-timeout's timer (setup, test and teardown together) is stopped first: a test failing near its limit
    must not have this wait cut short, which would leave the driver running into `ray.shutdown()`."""
    yield
    if not RunInThread.left:
        return
    getattr(request.node, "cancel_timeout", lambda: None)()
    left = [problem for run in list(RunInThread.left) if (problem := run.end())]
    if left:  # Ray would end this process at the driver's next call after ray.shutdown(): say so where it shows
        print(f"driver threads still running: {left}", file=sys.__stderr__, flush=True)
        pytest.fail(f"driver threads still running after their abort: {left}", pytrace=False)


def named_actor(name: str, address: str):
    """The live actor `name` of the cluster at `address`, in whichever namespace its driver has (each driver's job
    has a namespace of its own); None while there is none."""
    from ray.util.state import list_actors

    found = list_actors(address=address, filters=[("name", "=", name), ("state", "=", "ALIVE")])
    return ray.get_actor(name, namespace=found[0].ray_namespace) if found else None


def ended(drivers: dict) -> str | None:
    """Which of `drivers` (name -> Driver) has ended already, while the run should still go on, if any."""
    return next((f"{name}'s driver ended (exit {d.process.returncode})" for name, d in drivers.items()
                 if d.process.poll() is not None), None)


def events_of(actor, kind: str) -> list[dict]:
    """The events of `kind` a region's SyncActor has recorded so far (summary.json's `events` while it runs)."""
    return [e for e in ray.get(actor.stats.remote())["events"] if e["event"] == kind]


def while_running(drivers: dict):
    """`wait_for` for a wait while the run of `drivers` goes on: a driver that ended fails it at once."""
    def running(predicate, timeout, what):
        return wait_for(predicate, timeout, what, fail_if=lambda: ended(drivers))
    return running


def wait_for(predicate, timeout, what, fail_if=lambda: None):
    """`predicate()`'s first true value within `timeout` seconds (its exceptions count as not yet); `fail_if()`
    returning a reason (a process the wait depends on has ended) fails the wait at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reason = fail_if()
        if reason:
            raise AssertionError(f"{reason}, waiting for {what}")
        try:
            value = predicate()
            if value:
                return value
        except Exception:  # e.g. the actor is not created yet
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def free_port() -> int:
    """A TCP port free on this machine now (for a server a test starts)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on this machine now: each probe holds its port until all are chosen. Probed
    one after the other, two may be the same: a CI run's head got one port for two of its components and never
    started ("Ray component metrics_export is trying to use a port number 57431 that is used by other
    components")."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


# The components of a `ray start --head` that listen on ports of their own besides the GCS and the dashboard: given
# free ones, a second Ray on the machine (another test's, a user's) cannot take a head's.
HEAD_COMPONENT_PORT_FLAGS = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
                             "metrics-export-port", "ray-client-server-port")


def head_ports() -> tuple[int, int, list[str]]:
    """Distinct free ports for a `ray start --head`: its GCS port, its dashboard's, and the flags giving its other
    components theirs (HEAD_COMPONENT_PORT_FLAGS)."""
    gcs, dashboard, *others = free_ports(2 + len(HEAD_COMPONENT_PORT_FLAGS))
    return gcs, dashboard, [f"--{flag}={port}" for flag, port in zip(HEAD_COMPONENT_PORT_FLAGS, others)]


def kill(pids: list[int]) -> None:
    """SIGKILL to each of `pids` still there (one gone meanwhile is no error)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def run_process_ids(run_name: str, regions: list[str]) -> list[int]:
    """The processes of a run's actors as they are now (found by the run's actor names, see
    `driver.run_actor_name`) and everything they started (Hivemind's averager and DHT processes, p2pd)."""
    names = [f"diloco-{kind}-{run_name}-{region}" for kind in ("sync", "stream") for region in regions]
    pids = []
    drivers_regions = "+".join(regions)
    for name in [*names, f"diloco-data-{run_name}-{drivers_regions}", f"diloco-eval-{run_name}-{drivers_regions}"]:
        try:
            actor = ray.get_actor(name)
        except ValueError:  # not started (the evaluator without eval_every) or already gone
            continue
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        pids += [pid, *descendants(pid)]
    return pids


def assert_gone(pids: list[int], timeout: float = 15) -> None:
    """None of `pids` is alive within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.5)
    left = [p for p in pids if alive(p)]
    assert not left, f"processes of the run still alive {timeout}s after it ended: {left}"


def driver_env(**extra):
    """This process's environment for a driver of its own (never attached to a Ray another test points at)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    env.pop("RAY_ADDRESS", None)
    return env


class Driver:
    """`ray-diloco train` in a process of its own; its output is read as it comes. A test that watches a run on a
    cluster it started (tests/autoscaling_head.py) runs the driver so, never in a thread of its own process: when
    such a test failed, its clean-up shut Ray down and stopped the head while the driver thread went on, that
    thread's next Ray call connected to the stopped head, and Ray ended the whole pytest process (exit 1, no
    report of the failure: seen in CI)."""

    def __init__(self, argv, env):
        self.process = subprocess.Popen([sys.executable, "-m", "ray_diloco.cli", "train", *argv], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)

    def wait_for_line(self, text, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return
            assert self.process.poll() is None, "driver ended early:\n" + "".join(self.lines[-40:])
            time.sleep(0.2)
        raise AssertionError(f"no line with {text!r} within {timeout}s:\n" + "".join(self.lines[-40:]))

    def stop(self):
        """SIGTERM, as `ray job stop` sends; returns the processes the driver had started just before."""
        started = descendants(self.process.pid)
        self.process.send_signal(signal.SIGTERM)
        return started

    def output(self):
        return "".join(self.lines)

    def end(self) -> None:
        """A driver a failed test left running: SIGTERM twice (the second stops the run at once, as the README
        says), SIGKILL after 60 s, and whatever it had started (its private Ray, Hivemind's processes) killed."""
        if self.process.poll() is not None:
            return
        started = self.stop()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        kill(started)


class SameBatch:
    """A data stream for an inner step that yields one batch over and over."""

    def __init__(self, batch):
        self.batch = batch

    def next(self):
        return self.batch


def run_gloo_ranks(target, world: int, rows: int, timeout: float = 300) -> list:
    """`target(rank, port, results)` in `world` spawned processes that form a gloo group on a free port; returns
    the `rows` items they put on `results`. A rank that dies fails the test at once, not after the timeout."""
    import multiprocessing
    import queue
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=target, args=(rank, port, results)) for rank in range(world)]
    for process in processes:
        process.start()
    got, deadline = [], time.monotonic() + timeout
    while len(got) < rows:
        crashed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
        assert not crashed and time.monotonic() < deadline, f"a rank ended with {crashed}; got {len(got)} rows"
        try:
            got.append(results.get(timeout=1))
        except queue.Empty:
            pass
    for process in processes:
        process.join(timeout=60)
    return got
