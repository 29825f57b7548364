"""Releasing a run's actors (`ray_diloco.lifecycle`): each is closed, killed and waited for until Ray reports it
dead, without Ray printing a failed task at the end of every run (real Ray, in a process of its own: the line
comes through the driver's log stream)."""

import subprocess
import sys

SCRIPT = """
import time, ray
from ray_diloco.lifecycle import release_all, wait_until_dead

@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)  # as RegionStream: its calls are retried
class Restartable:
    def ping(self):
        return 1
    def close(self):
        time.sleep(0.5)

ray.init(address="local", num_cpus=1, include_dashboard=False)
actors = [Restartable.remote() for _ in range(4)]
ray.get([a.ping.remote() for a in actors])
release_all([(a, "close") for a in actors])
print("left", len(wait_until_dead(actors, timeout=30)), flush=True)
time.sleep(3)  # the log stream's forwarding
ray.shutdown()
"""


def test_released_actors_that_retry_their_calls_are_waited_for_without_a_failed_task_line():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "left 0" in done.stdout, output[-3000:]
    # It was `Task Restartable.__ray_ready__ failed. There are infinite retries remaining, …` (wait_until_dead's
    # liveness call, retried on a killed actor).
    assert "__ray_ready__ failed" not in output, output[-3000:]
