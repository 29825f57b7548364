"""Regions whose drivers live and die apart (one Ray cluster per region): the run's final state outlives the
driver that made it.

Real processes: three `ray-diloco train --local-regions <region>` drivers, each with a private Ray of its own, a
local directory standing for the bucket the clusters share.
- b starts first and a once b's SyncActor has published its peer file; b is late for the last round (its workers are
  held before the exchange of round 1 until a's driver has exited). Started together, a loaded machine could start b
  more than a round behind a: b then adopted a's state at its first exchange and joined round 1 in that same call,
  never reaching the hold (seen in CI). Started first, b begins training before a, and a would have to overtake it
  by a whole round; whoever goes alone at round 0, b's next exchange is the held one. Then a runs that round alone,
  finishes and its driver exits, its DHT record gone. b then arrives and must end on a's final θ_global, taken from
  the run's storage (before: it ran the round alone and finished "settled" on another state, saying nothing).
- c's driver starts after both have finished, with a's stored final state corrupted: it must reject that one (the
  digest check), take b's (the same state), train nothing and end on the same θ_global.
"""

import json

import torch
import yaml

from conftest import TEST_DATA, Driver, driver_env, wait_for
from ray_diloco.config import ExperimentConfig
from ray_diloco.sync.peers import read_peer_files
from ray_diloco.worker import SLOW_REGION_ENV_VAR

T = 2


def run_config(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "regions": [{"name": name, "workers": 1} for name in ("a", "b", "c")],
        "outer": {"inner_steps": 2, "max_wait_seconds": 3, "matchmaking_seconds": 1, "averaging_timeout": 10},
        # A checkpoint every step: the one of the last step comes after a finished, and must not replace its
        # stored final record.
        "run": {"name": "late", "outer_steps": T, "output_dir": str(tmp_path), "stop_timeout_seconds": 60,
                "checkpoint_every": 1},
        "inner": {"warmup_steps": 1}, "data": TEST_DATA}))
    return str(config)


def finish(driver: Driver, timeout: float) -> str:
    code = driver.process.wait(timeout=timeout)
    out = driver.output()
    assert code == 0, out[-4000:]
    return out


def test_a_late_region_and_one_started_after_the_run_take_the_final_state_from_storage(tmp_path):
    config = run_config(tmp_path)
    gate = tmp_path / "a-exited"  # b's last exchange waits for it
    env = driver_env(**{SLOW_REGION_ENV_VAR: f"b:{gate}:1"})
    b = Driver(["--config", config, "--local-regions", "b"], env)
    peers = ExperimentConfig.from_yaml(open(config).read()).run.peers_dir()
    wait_for(lambda: "b" in read_peer_files(peers, exclude="a"), 300, "b's peer file")
    a = Driver(["--config", config, "--local-regions", "a"], env)
    finish(a, timeout=400)
    gate.touch()
    out_b = finish(b, timeout=400)
    results = tmp_path / "late"
    summary = {region: json.loads((results / f"summary-{region}.json").read_text()) for region in ("a", "b")}
    final = summary["a"]["global_digest"]["a"]
    assert [r["outer_step"] for r in summary["a"]["rounds"]["a"]][-1] == T - 1  # a ran the last round alone
    assert summary["b"]["global_digest"]["b"] == final, out_b[-4000:]
    assert summary["b"]["finished_elsewhere"] == {"a": final} and not summary["b"]["unsettled"]
    # The final state came from storage (a's driver was gone). On a loaded machine b may also have missed an
    # earlier round and re-synced from a live a first: that adoption has another digest.
    took = [e for e in summary["b"]["events"] if e["event"] in ("resync", "settled_at_end") and e["digest"] == final]
    assert took and took[0]["source"] == "storage", summary["b"]["events"]

    # a's stored final state no longer matches its record: c rejects it and takes b's.
    stored = tmp_path / "late" / "states" / "a" / f"outer-{T:06d}" / "outer_state.pt"
    state = torch.load(stored, weights_only=True)
    first = sorted(state["theta"])[0]
    state["theta"][first] = state["theta"][first] + 1.0
    torch.save(state, stored)
    c = Driver(["--config", config, "--local-regions", "c"], env)
    out_c = finish(c, timeout=400)
    summary_c = json.loads((results / "summary-c.json").read_text())
    assert summary_c["global_digest"]["c"] == final and not summary_c["unsettled"], out_c[-4000:]
    events = [e["event"] for e in summary_c["events"]]
    assert "stored_state_rejected" in events and "region_joined" in events, summary_c["events"]
    assert summary_c["rounds"]["c"] == []  # it trained nothing: the run was over
