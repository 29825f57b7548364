"""A region steadily slower than the old matchmaking window still averages with the other in every round.

Two regions of one worker on a local Ray (real Ray Train, FSDP2 over gloo, Hivemind on 127.0.0.1); region r1's
workers sleep SLOW seconds after each H inner steps (the test-only hook RAY_DILOCO_TEST_SLOW_REGION, set through
the job's runtime_env). SLOW is twice the old rendezvous deadline (matchmaking_seconds + 1 s), under which r0 went
alone every round and r1 re-synced forward. With readiness records r0 waits for r1 (up to outer.max_wait_seconds):
every round has both regions, the rounds are consistent and bit-identical, and r0's rounds show the wait.
"""

import dataclasses

import pytest
import ray
from test_multiregion import assert_regions_agree_every_round

from conftest import small_run
from ray_diloco.driver import run_training
from ray_diloco.worker import SLOW_REGION_ENV_VAR

MATCHMAKING = 3.0
SLOW = 2 * (MATCHMAKING + 1.0)


@pytest.fixture(scope="module")
def slow_r1_ray():
    ray.init(address="local", num_cpus=8, include_dashboard=False,
             runtime_env={"env_vars": {SLOW_REGION_ENV_VAR: f"r1:{SLOW}"}})
    yield
    ray.shutdown()


def test_a_steadily_slower_region_joins_every_round(slow_r1_ray, tmp_path):
    cfg = small_run(tmp_path, "slow-region", workers=[1, 1], inner_steps=4, outer_steps=3,
                    matchmaking_seconds=MATCHMAKING)
    cfg = dataclasses.replace(cfg, outer=dataclasses.replace(cfg.outer, max_wait_seconds=60.0))
    summary = run_training(cfg)
    assert_regions_agree_every_round(summary, cfg)
    assert not [e for e in summary["events"] if e["event"] in ("resync", "regions_absent")], summary["events"]
    # r0 was ready about SLOW seconds before r1 every round and waited for it instead of going alone.
    waits = [r["all_reduce_seconds"] for r in summary["rounds"]["r0"]]
    assert min(waits) > MATCHMAKING + 1.0, waits
