"""Live metrics without a training run: the Grafana board uses only metrics the code exports (no dead
panels), the names Ray's metrics agent really exports (scraped from a node's metrics port), the MFU formula
against a hand count, the driver's live summary line, loss.png, and the job's dashboard metadata."""

import json
import math
import pathlib
import re
import time
import urllib.request

import pytest
import ray

from ray_diloco import metrics
from ray_diloco.config import ModelConfig
from ray_diloco.live_summary import summary_line
from ray_diloco.plots import write_loss_png

BOARD = pathlib.Path(__file__).resolve().parents[1] / "cluster" / "grafana" / "ray-diloco.json"


def board_exprs() -> list[str]:
    board = json.loads(BOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p["targets"]]


def board_metric_names() -> set[str]:
    return {name for expr in board_exprs() for name in re.findall(r"\bray_ray_diloco_[a-z_]+", expr)}


def test_every_metric_on_the_board_is_exported_by_the_code():
    used = board_metric_names()
    assert used, "the board queries no ray_diloco metric"
    assert used <= metrics.EXPORTED_NAMES, f"dead panels: {sorted(used - metrics.EXPORTED_NAMES)}"
    # And every panel queries at least one of them, scoped to the chosen run.
    for expr in board_exprs():
        assert re.search(r"ray_ray_diloco_\w+\{run=~\"\$run\"[,}]", expr), expr


def test_board_is_importable_grafana_json():
    board = json.loads(BOARD.read_text())
    assert board["title"] and board["panels"] and board["schemaVersion"] >= 30
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus" and "run" in variables
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    # Import asks for the data source (`__inputs`), and the data-source variable starts on it.
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    assert variables["datasource"]["current"]["value"] == "${DS_PROMETHEUS}" and "region" in variables
    # Counters are read through increase()/rate() (or, for one-off events, max_over_time per process series): a
    # raw sum drops when a resubmitted job restarts them.
    for expr in board_exprs():
        for counter in re.findall(r"ray_ray_diloco_\w+_(?:total|bucket)\b", expr):
            assert re.search(rf"(increase|rate|max_over_time)\({counter}\{{", expr), expr
    phases = next(p for p in board["panels"] if "phases" in p["title"])
    assert phases["repeat"] == "region" and 'region=~"$region"' in phases["targets"][0]["expr"]


def test_names_and_descriptions():
    for name, (kind, description, tags) in metrics.DEFINITIONS.items():
        assert kind in ("gauge", "counter", "histogram") and tags[0] == "run"
        assert description.isascii(), f"{name}: Ray refuses non-ASCII descriptions"
    assert all(n.startswith("ray_ray_diloco_") for n in metrics.EXPORTED_NAMES)


def test_flops_per_token_by_hand():
    cfg = ModelConfig(hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1)
    # per layer: q, o 8·8 each; k, v 8·4 each (one kv head of width 4); gate, up, down 8·16 each
    per_layer = 64 + 64 + 32 + 32 + 3 * 128
    expected = 6 * (2 * per_layer + 8 * 100) + 12 * 2 * 8 * 32
    assert metrics.flops_per_token(cfg, vocab_size=100, seq_len=32) == expected


def test_peak_flops(monkeypatch):
    monkeypatch.delenv(metrics.PEAK_FLOPS_ENV_VAR, raising=False)
    assert metrics.peak_flops("cpu") == metrics.DEFAULT_CPU_PEAK_FLOPS == 1e11
    assert metrics.peak_flops("cuda", "NVIDIA H100 80GB HBM3") == 989e12
    monkeypatch.setenv(metrics.PEAK_FLOPS_ENV_VAR, "2.5e12")
    assert metrics.peak_flops("cpu") == 2.5e12


def test_recording_outside_ray_never_raises():
    metrics.safely(metrics.record_round, "run", "r0", 1, 2, {"all_reduce": 0.2}, 10, 20, 3)
    metrics.safely(metrics.record_inner_step, "run", "r0", 0, 0.0, 0, 1.0, 1.0, None, None)


@pytest.fixture
def private_ray():
    ray.init(address="local", num_cpus=1, include_dashboard=False,
             _system_config={"metrics_report_interval_ms": 500})
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
def _record_everything():
    metrics.record_inner_step("names", "r0", 0, 0.5, 1000, 1e6, 1e11, loss=5.0, lr=1e-3)
    metrics.record_compute_utilization("names", "r0", 0, 0.9)
    metrics.record_round("names", "r0", 1, 2, {"wait_for_shards": 0.1, "wait_for_peers": 0.5, "all_reduce": 0.2,
                                               "apply": 0.3}, 100, 200, connected_peers=1, parameters=1000)
    metrics.record_region_workers("names", "r0", 2)
    metrics.record_checkpoint("names", "r0", outer_step=1, seconds=0.7)
    metrics.record_outer_step("names", "r0", 1)
    metrics.record_event("names", "r0", "resync")
    metrics.record_eval("names", 1, 4.0, math.exp(4.0))
    metrics.record_skipped_records("names", 3)
    time.sleep(3)  # the core worker reports every 0.5 s here; stay alive until it has


def test_exported_names_on_the_node_metrics_port(private_ray):
    ray.get(_record_everything.remote())
    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    deadline, missing = time.monotonic() + 30, metrics.EXPORTED_NAMES
    while missing and time.monotonic() < deadline:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        exported = {line.split("{")[0] for line in text.splitlines() if line.startswith("ray_ray_diloco_")}
        missing = metrics.EXPORTED_NAMES - exported
        time.sleep(1)
    assert not missing, f"not on {url}: {sorted(missing)}"
    assert 'run="names"' in text and 'region="r0"' in text and 'phase="all_reduce"' in text


def test_summary_line():
    record = {"outer_step": 1, "group_size": 2, "seconds": 1.3, "wait_seconds": 0.1, "all_reduce_seconds": 1.0,
              "wait_for_peers_seconds": 0.7, "transfer_seconds": 0.3, "apply_seconds": 0.2, "bytes_sent": 1_200_000,
              "loss": 7.4321, "tokens_per_second": 650.0}
    line = summary_line(2, 3, {"r0": record, "r1": {}}, {"outer_step": 2, "eval_loss": 7.21})
    assert line == ("[driver] outer 2/3 | held-out 7.2100 @2 | r0@2: loss 7.4321, 650 tok/s, 2 region(s), 1.30s "
                    "(shards 0.10 / peers 0.70 / all-reduce 0.30 / apply 0.20), 1.2 MB out | r1: no round yet")


def test_loss_png(tmp_path):
    summary = {"run": "t", "mode": "diloco", "regions": [{"name": "a"}, {"name": "b"}], "inner_steps": 2,
               "outer_steps": 2, "loss_curve": {"a": [[1, 9.0], [2, 8.0], [3, 7.5], [4, 7.0]],
                                                "b": [[1, 9.1], [2, 8.2], [3, 7.4], [4, 7.1]]},
               "eval_curve": [{"outer_step": 0, "eval_loss": 9.5}, {"outer_step": 1, "eval_loss": 8.0},
                              {"outer_step": 2, "eval_loss": 7.2}]}
    path = write_loss_png(summary, tmp_path / "loss.png")
    assert path == tmp_path / "loss.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_job_metadata():
    from ray_diloco.ray_connection import job_metadata
    from conftest import small_run

    cfg = small_run(pathlib.Path("/tmp"), "meta-run", [2, 1])
    metadata = job_metadata(cfg, cfg.regions).metadata
    assert metadata["ray_diloco_run"] == "meta-run" and metadata["regions"] == "r0:2,r1:1"
    assert all(isinstance(v, str) for v in metadata.values())
