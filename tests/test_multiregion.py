"""The multi-region DiLoCo run end to end: real Ray (local), real FSDP2 over gloo, real Hivemind on 127.0.0.1.

Checks that after every outer step all regions hold bit-identical θ_global, that the held-out loss falls,
that regions of different sizes train together (with the overlapped outer step), and that the distributed run
computes DiLoCo exactly: the plain-PyTorch outer step of `ray_diloco.sync.outer`, fed what each region actually
sent, reproduces every θ_global to fp16 wire rounding (token-weighted, with the right sign).

The run has a secret (outer.secret_file) and an intruder beside it (tests/intruder.py: real Hivemind, our own
code, the run's name and config, not its secret) forging records, asking for the state and trying to join every round
with a Δ of 1000 at weight 10^6: the run's every round is still the two regions' exact DiLoCo step, and the
intruder's downloads are refused and counted (`peer_rejected`).

The same run is scraped by a real Prometheus (tests/prometheus_board.py: Debian's `prometheus`, reading the
service-discovery file Ray's own scrape config names) and federated by a second one: every query of the Grafana board
(cluster/grafana/ray-diloco.json) must return series for both regions with plausible values (loss finite and
falling, bytes > 0, outer step = T, both regions in every round), the federated series carry the cluster's label, and
the driver's live summary lines and loss.png are there. That test skips where the `prometheus` binary is not
installed (`.ci/run` installs it with apt-get where it can). One run for both (each costs two minutes of CI).
"""

import contextlib
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from conftest import assert_gone, run_process_ids, small_run
from prometheus_board import (NOT_INSTALLED, check_board, check_federation, federation_config,
                              ray_scraped_by_prometheus, running_prometheus)
from test_metrics import board_exprs
from ray_diloco.driver import run_training
from ray_diloco.model import build_model, parameter_state
from ray_diloco.sync.outer import OuterOptimizer, pseudo_gradient, weighted_average


def run_recording(cfg):
    """The run's summary and each region's recorded rounds; also checks that no process of the run (its actors
    and what they started) outlives `run_training` (a finished run)."""
    recorded, pids = {}, []

    def grab(actors):
        for region, actor in zip(cfg.regions, actors):
            recorded[region.name] = ray.get(actor.recorded_rounds.remote())
        pids.extend(run_process_ids(cfg.run.name, [r.name for r in cfg.regions]))

    summary = run_training(cfg, before_shutdown=grab)
    assert len(pids) >= 4 * len(cfg.regions), pids  # SyncActor, its DHT and averager processes, p2pd; the stream
    assert_gone(pids)
    return summary, recorded


def assert_regions_agree_every_round(summary, cfg):
    names = [r.name for r in cfg.regions]
    assert summary["regions_agree"]
    for step in range(cfg.run.outer_steps):
        rounds = [summary["rounds"][name][step] for name in names]
        assert {r["group_size"] for r in rounds} == {len(names)}, rounds
        assert len({r["digest"] for r in rounds}) == 1, f"outer step {step}: regions disagree {rounds}"
        assert all(r["consistent"] for r in rounds)


def assert_matches_plain_pytorch_outer_step(summary, recorded, cfg):
    """Replay every round through OuterOptimizer + weighted_average with the recorded θ_region and tokens. With
    outer.overlap, each region's Δ is taken from the base its workers trained from: θ_global before the previous
    round plus the drift they had then (ray_diloco.sync.actor), rebuilt here from what the regions sent."""
    first = recorded[cfg.regions[0].name]
    vocab = first[0]["local"]["model.embed_tokens.weight"].shape[0]
    init = parameter_state(build_model(cfg.model, vocab, cfg.data.seq_len, cfg.run.seed))
    reference = OuterOptimizer(init, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov)
    bases = {r.name: None for r in cfg.regions}  # None: the workers trained from θ_global
    for step in range(cfg.run.outer_steps):
        before = {k: v.clone() for k, v in reference.global_state().items()}
        regions = [recorded[r.name][step] for r in cfg.regions]
        deltas = [pseudo_gradient(bases[r.name] or before, round_["local"]) for r, round_ in zip(cfg.regions, regions)]
        weights = [r["tokens"] for r in regions]
        overlapped = {summary["rounds"][r.name][step]["overlapped"] for r in cfg.regions}
        assert overlapped == {cfg.outer.overlap and step + 1 < cfg.run.outer_steps}, (step, overlapped)
        for r, round_ in zip(cfg.regions, regions):
            base = bases[r.name] or before
            bases[r.name] = {k: before[k] + (round_["local"][k] - base[k]) for k in before} \
                if overlapped == {True} else None
        expected = reference.step(weighted_average(deltas, weights, cfg.outer.compression))
        actual = regions[0]["global_after"]
        for name in expected:
            update = (before[name] - expected[name]).abs().max().item()
            error = (actual[name] - expected[name]).abs().max().item()
            assert update > 0, f"{name} did not move in outer step {step}"
            # fp16 on the wire: each Δ and the averaged Δ are rounded to 11 significant bits.
            assert error <= 1e-2 * update + 1e-7, f"{name} step {step}: error {error:.3g} vs update {update:.3g}"
        # Re-anchor on the distributed θ_global so rounding does not compound across steps.
        for name, param in reference.params.items():
            param.data.copy_(actual[name])


class _Tee(io.TextIOBase):
    """Writes to each of its streams: the run's console output is kept for a test and still shown."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self):
        for stream in self.streams:
            stream.flush()


@pytest.fixture(scope="module")
def hetero(tmp_path_factory):
    """The module's one run: regions of 1 and 2 workers, the overlapped outer step (every round but the last runs
    while the workers train on), a secret, an intruder beside them, a checkpoint at the end (the board's
    checkpoint panels), scraped by Prometheus and federated where it is installed (the global Prometheus federates
    while the run is live: a finished run's series go stale in the regional one once its actors are gone, and
    /federate serves only live series). Both Prometheus servers serve the module's tests after the run."""
    tmp_path = tmp_path_factory.mktemp("hetero")
    secret = tmp_path / "run.secret"
    secret.write_text(os.urandom(32).hex())
    # A checkpoint at the last outer step only: a checkpointed round blocks (it cannot overlap), and the last does.
    cfg = small_run(tmp_path, "hetero", workers=[1, 2])
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, checkpoint_every=cfg.run.outer_steps))
    cfg = dataclasses.replace(cfg, outer=dataclasses.replace(cfg.outer, overlap=True, secret_file=str(secret)))
    (tmp_path / "run.yaml").write_text(cfg.to_yaml())
    report = tmp_path / "intruder.json"
    with ray_scraped_by_prometheus(tmp_path / "prometheus") as port, \
            (running_prometheus(tmp_path / "global", federation_config(port)) if port else contextlib.nullcontext()) \
            as global_port:
        intruder = subprocess.Popen([sys.executable, str(Path(__file__).with_name("intruder.py")),
                                     str(tmp_path / "run.yaml"), str(report)], start_new_session=True)
        console, started = io.StringIO(), time.time()
        try:
            with contextlib.redirect_stdout(_Tee(sys.stdout, console)):
                summary, recorded = run_recording(cfg)
        finally:  # its group: the intruder and what it started (its DHT process, p2pd, averagers)
            os.killpg(intruder.pid, signal.SIGKILL)
            intruder.wait(30)
        yield dict(cfg=cfg, secret=secret, summary=summary, recorded=recorded, tried=json.loads(report.read_text()),
                   console=console.getvalue(), started=started, finished=time.time(), port=port,
                   global_port=global_port, results=tmp_path / cfg.run.name)


def test_regions_of_one_and_two_workers_overlapped_agree_bit_for_bit_and_learn_with_an_intruder_beside_them(hetero):
    cfg, secret, summary, recorded = (hetero[key] for key in ("cfg", "secret", "summary", "recorded"))
    tried = hetero["tried"]
    assert tried["forged_stores"] and tried["download_attempts"] and tried["average_attempts"], tried
    assert tried["downloads_served"] == 0 and tried["largest_group"] <= 1, tried
    rejected = [e for e in summary["events"] if e["event"] == "peer_rejected"]
    assert {e["peer"] for e in rejected} == {tried["peer_id"]}, rejected  # the intruder, never a region
    assert "a state download" in {e["what"] for e in rejected}, rejected  # (a join is refused only if it came)
    assert secret.read_text() not in json.dumps(summary)
    assert not [e for e in summary["events"] if e["event"] in ("worker_restart", "inner_state_reset")], \
        summary["events"]  # the workers trained from the overlapped hand-backs, not from a restart's θ_global
    assert_regions_agree_every_round(summary, cfg)
    assert summary["eval_loss"] < summary["eval_loss_at_start"] - 0.5, summary
    # The 2-worker region trains twice the tokens, so it weighs twice as much in the average.
    assert recorded["r1"][0]["tokens"] == 2 * recorded["r0"][0]["tokens"]
    assert_matches_plain_pytorch_outer_step(summary, recorded, cfg)
    assert summary["regions"] == [{"name": "r0", "workers": 1}, {"name": "r1", "workers": 2}]
    # Two regions, fp16: each region sends half its Δ and returns half the average, 2 bytes each.
    params = sum(t.numel() for t in recorded["r0"][0]["local"].values())
    for region in ("r0", "r1"):
        per_round = summary["comm_bytes_sent"][region] / cfg.run.outer_steps
        assert abs(per_round - 2 * params) / (2 * params) < 0.02, (per_round, params)
    assert summary["tokens"] == (1 + 2) * cfg.total_inner_steps * cfg.data.batch_size * cfg.data.seq_len
    assert summary["skipped_records"] == 0


def test_every_board_query_returns_both_regions(hetero):
    if hetero["port"] is None:
        pytest.skip(NOT_INSTALLED)
    cfg, summary, T = hetero["cfg"], hetero["summary"], hetero["cfg"].run.outer_steps
    assert summary["regions_agree"]
    # Prometheus has the last values once the agent reported (1 s), it scraped and the global one federated (1 s).
    time.sleep(max(0.0, hetero["finished"] + 6 - time.time()))
    check_federation(hetero["global_port"], cfg)
    # The driver's live lines, its last line, and the picture.
    out = hetero["console"]
    assert f"[driver] outer {T}/{T}" in out, out[-3000:]
    png = hetero["results"] / "loss.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and f"[driver] loss curves: {png}" in out
    assert set(summary["loss_curve"]) == {"r0", "r1"} and len(summary["loss_curve"]["r0"]) == cfg.total_inner_steps
    check_board(hetero["port"], cfg, summary, hetero["started"], time.time(), board_exprs())
