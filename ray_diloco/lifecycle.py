"""How the driver runs its regions' Ray Train groups, aborts them on a stop that timed out, and releases the
run-scoped actors so that no process of a run outlives `run_training`.

Each region's `TorchTrainer.fit()` blocks until its group ends, so each runs in a daemon thread of its own and
the main thread polls: it can then act on a stop (`RunStop.deadline_passed`) while fits are still blocked,
which a `ThreadPoolExecutor` cannot (its `with` block waits for every fit before anything else runs).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import ray

from ray_diloco.stopping import RunStop

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.25
# After the controllers are killed, how long a fit() may take to notice before its region is reported aborted.
ABORT_GRACE_SECONDS = 20.0
# How long each run-scoped actor gets to end by itself (close its reader, shut down Hivemind) before ray.kill.
RELEASE_SECONDS = 15.0
FIT_THREAD_PREFIX = "fit-"  # each region's fit() thread: "fit-<region>" (tests wait for what an abort left running)


class RegionAborted(RuntimeError):
    """A region's group was aborted by the driver: no outer-step boundary within run.stop_timeout_seconds."""


def fit_in_background(fit, trainer: Any, actor: Any, name: str) -> Future:
    """`fit(trainer, actor)` in a daemon thread (a driver that must stop never waits on it to exit)."""
    future: Future = Future()

    def target() -> None:
        try:
            future.set_result(fit(trainer, actor))
        except BaseException as error:  # fit catches training errors; anything else is reported here
            future.set_exception(error)

    threading.Thread(target=target, name=f"{FIT_THREAD_PREFIX}{name}", daemon=True).start()
    return future


def wait_for_groups(futures: list[Future], names: list[str], stop: RunStop | None
                    ) -> list[tuple[Any, BaseException | None]]:
    """Every group's (result, error); on a stop whose deadline passed, the groups still training are aborted
    (their Ray Train controllers killed) and reported as `RegionAborted`."""
    while not all(f.done() for f in futures):
        if stop is not None and stop.deadline_passed():
            running = [name for name, f in zip(names, futures) if not f.done()]
            why = "a second signal" if stop.forced else f"no outer-step boundary within {stop.timeout:.0f} s"
            print(f"[driver] stop: {why}; aborting the training of {running}", flush=True)
            abort_training_controllers()
            deadline = time.monotonic() + ABORT_GRACE_SECONDS
            while not all(f.done() for f in futures) and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)
            return [_after_abort(name, f, name in running, why) for name, f in zip(names, futures)]
        time.sleep(POLL_SECONDS)
    return [f.result() for f in futures]


def _after_abort(name: str, future: Future, was_running: bool, why: str) -> tuple[Any, BaseException | None]:
    """A group that was still training when the stop aborted it reports `RegionAborted` (however its fit then
    ended); one that had finished keeps its own outcome."""
    if was_running and (not future.done() or future.result()[1] is not None):
        return None, RegionAborted(f"{name}: training aborted by the stop ({why})")
    return future.result()


def abort_training_controllers() -> None:
    """Kill the Ray Train controllers of this driver's job that are alive. Ray Train V2 keeps no handle we could
    call `abort` on, so they are found in the GCS actor table (`ray._private.state`, no dashboard needed) and
    killed by id; each group's workers are owned by their controller and die with it. Relies on Ray 2.60's
    private state API and `CoreWorker.kill_actor` (pinned: ray<2.61; tests/test_stop.py runs this path)."""
    from ray._private import state

    job = ray.get_runtime_context().get_job_id()
    for actor_id, info in state.actors().items():
        if info.get("ActorClassName") == "TrainController" and info.get("JobID") == job \
                and info.get("State") != "DEAD":
            try:
                ray._private.worker.global_worker.core_worker.kill_actor(ray.ActorID.from_hex(actor_id), True)
            except Exception as error:
                logger.warning("could not kill Ray Train controller %s: %s", actor_id, error)


def release_all(actors: list[tuple[Any, str | None]]) -> None:
    """End the run-scoped actors: each one's closing method first (it stops its own threads and child processes:
    Hivemind's, Ray Data's reader), all at once under one bound, then `ray.kill` (no restart) every one. Ray kills
    a killed worker's whole process group, so what a hung actor started goes with it."""
    calls = {}
    for actor, method in actors:
        if actor is not None and method is not None:
            try:
                calls[getattr(actor, method).remote()] = method
            except Exception as error:  # a dead actor: nothing to close
                logger.warning("%s of a run actor could not be called: %s", method, error)
    if calls:
        done, pending = ray.wait(list(calls), num_returns=len(calls), timeout=RELEASE_SECONDS)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                logger.debug("a run actor was already gone before its %s", calls[ref])
            except Exception as error:  # its own failure must not hide the run's outcome
                logger.warning("%s of a run actor failed: %s", calls[ref], type(error).__name__)
        if pending:
            logger.warning("%d run actor(s) did not close within %.0f s; killing them", len(pending), RELEASE_SECONDS)
    for actor, _ in actors:
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as error:
                logger.warning("ray.kill of a run actor failed: %s", error)


def end_actors(actors: list[tuple[Any, str | None]]) -> list[Any]:
    """`release_all`, then `wait_until_dead`: the actors still alive after that (None entries are skipped)."""
    release_all(actors)
    return wait_until_dead([actor for actor, _ in actors])


def wait_until_dead(actors: list[Any], timeout: float = RELEASE_SECONDS) -> list[Any]:
    """The actors still alive after `timeout` (an empty list once Ray reports every one dead)."""
    pending = [a for a in actors if a is not None]
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        pending = [actor for actor in pending if _not_dead(actor)]
        if pending:
            time.sleep(POLL_SECONDS)
    return pending


def _not_dead(actor: Any) -> bool:
    """False once Ray reports the actor dead; an answer, or none within a second, counts as alive. No retries: for
    an actor that retries its calls (RegionStream), the call that found it killed was retried and Ray printed a
    `Task ….__ray_ready__ failed … will be retried` line at the end of every run."""
    try:
        ray.get(actor.__ray_ready__.options(max_task_retries=0).remote(), timeout=1)
    except ray.exceptions.ActorUnavailableError:  # a RayActorError too, but not dead: "may be available later"
        return True
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.GetTimeoutError:
        return True
    return True
