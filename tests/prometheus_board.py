"""A real Prometheus for tests: Debian's `prometheus` scraping Ray's metrics agent through the service-discovery
file Ray's own scrape config names, a second one federating it (cluster/prometheus/global-federation.yml), and the
checks every query of the Grafana board (cluster/grafana/ray-diloco.json) must pass on a finished 2-region run
(tests/test_multiregion.py runs them)."""

import contextlib
import json
import math
import pathlib
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import ray
import yaml

from conftest import free_port, wait_for

from ray_diloco import metrics

PROMETHEUS = shutil.which("prometheus")
NOT_INSTALLED = ("the `prometheus` binary is not installed (Debian: apt-get install prometheus; .ci/run does it "
                 "where apt-get works)")


def api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    answer = json.load(urllib.request.urlopen(url, timeout=30))
    assert answer["status"] == "success", answer
    return answer["data"]


@contextlib.contextmanager
def running_prometheus(work: pathlib.Path, config: dict):
    """A real Prometheus with `config` on a free loopback port, until the block ends."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen([PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
                                f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={work / 'data'}"],
                               stdout=open(work / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2)
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, (work / "prometheus.log").read_text()
                time.sleep(0.5)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def series_by(result: list[dict], label: str) -> dict[str, list[float]]:
    return {s["metric"].get(label, ""): [float(v) for _, v in s["values"]] for s in result}


def federation_config(regional_port: int) -> dict:
    """cluster/prometheus/global-federation.yml, its targets pointed at this test's Prometheus (one region's)."""
    config = yaml.safe_load((pathlib.Path(__file__).resolve().parents[1] / "cluster" / "prometheus"
                             / "global-federation.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    job = config["scrape_configs"][0]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{regional_port}"], "labels": {"ray_cluster": "local"}}]
    return config


def check_federation(port: int, cfg) -> None:
    """The global Prometheus got the run's ray_diloco series from the regional one, labelled with the cluster
    they came from, up to the last outer step."""
    query = f'max_over_time(ray_ray_diloco_outer_step{{run="{cfg.run.name}"}}[10m])'
    result = api(port, "query", query=query)["result"]
    assert {(s["metric"]["region"], s["metric"]["ray_cluster"], float(s["value"][1])) for s in result} == \
        {(r.name, "local", cfg.run.outer_steps) for r in cfg.regions}, result


def check_plausible(query: str, result: list[dict], summary: dict, cfg) -> None:
    T, regions = cfg.run.outer_steps, {r.name: r.workers for r in cfg.regions}
    metric = query.split("(")[-1].split("{")[0]
    last = {s["metric"].get("region", s["metric"].get("run")): float(s["values"][-1][1]) for s in result}
    if "histogram_quantile(" in query:  # round times: between 0 and the histogram's top bucket
        assert all(0 < v <= metrics.ROUND_SECONDS_BOUNDARIES[-1] for v in last.values()), (query, last)
    elif "rate(" in query or "increase(" in query or "max_over_time(" in query:
        assert max(max(float(v) for _, v in s["values"]) for s in result) > 0, query
        if metric == "ray_ray_diloco_events_total":
            started = {s["metric"]["region"] for s in result if s["metric"]["event"] == "sync_actor_started"}
            assert started == set(regions), result
    elif metric == "ray_ray_diloco_inner_loss":
        for region, losses in series_by(result, "region").items():
            assert losses[-1] < losses[0], f"{region}: loss did not fall: {losses}"
    elif metric == "ray_ray_diloco_outer_step":
        assert set(last.values()) == {T}, last
    elif metric == "ray_ray_diloco_round_regions":
        assert set(last.values()) == {len(regions)}, last
    elif metric == "ray_ray_diloco_eval_loss":  # the driver's evaluation at the end reaches the gauge too
        assert last == {summary["run"]: pytest.approx(summary["eval_loss"])}
        per_worker = T * cfg.outer.inner_steps * cfg.data.batch_size * cfg.data.seq_len  # written out, not the code's
        assert summary["eval_curve"][-1] == pytest.approx({"outer_step": T, "tokens_per_worker": per_worker,
                                                           "eval_loss": summary["eval_loss"],
                                                           "eval_perplexity": summary["eval_perplexity"]})
        assert list(last.values())[0] < summary["eval_loss_at_start"]
    elif metric == "ray_ray_diloco_eval_perplexity":
        assert list(last.values())[0] == pytest.approx(math.exp(summary["eval_loss"]), rel=1e-3)
    elif metric == "ray_ray_diloco_outer_round_seconds":
        phases = {s["metric"]["phase"] for s in result}
        assert phases == set(metrics.ROUND_PHASES), phases
        assert all(float(v) >= 0 for s in result for _, v in s["values"])
    elif metric in ("ray_ray_diloco_compute_utilization", "ray_ray_diloco_mfu"):
        assert all(0 < v <= 1 for v in last.values()), (metric, last)
    elif metric in ("ray_ray_diloco_tokens_per_second", "ray_ray_diloco_inner_step_seconds",
                    "ray_ray_diloco_learning_rate"):
        assert all(v > 0 for v in last.values()), (metric, last)
    elif metric == "ray_ray_diloco_region_workers":
        assert last == {name: float(workers) for name, workers in regions.items()}, last
    elif metric == "ray_ray_diloco_connected_peers":  # the other region's node at least
        assert all(v >= 1 for v in last.values()), last
    elif metric == "ray_ray_diloco_checkpoint_seconds":
        assert all(v > 0 for v in last.values()) and set(last) == set(regions), last
    elif metric == "ray_ray_diloco_last_checkpoint_step":
        assert last == {name: T for name in regions}, last
    elif metric == "ray_ray_diloco_skipped_records":
        assert last == {summary["run"]: float(summary["skipped_records"])}, last
    else:
        raise AssertionError(f"no plausibility check for {metric}: add one")
    assert metric in metrics.EXPORTED_NAMES


@contextlib.contextmanager
def ray_scraped_by_prometheus(work: pathlib.Path):
    """A local Ray and, where the binary is installed, a real Prometheus scraping it (through Ray's dashboard: its
    metrics head writes Ray's scrape config and service-discovery file): yields Prometheus' port, or None.
    The core workers report to the metrics agent every second (default 10 s), Prometheus scrapes every second."""
    ray.init(address="local", num_cpus=8, include_dashboard=PROMETHEUS is not None,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        if PROMETHEUS is None:
            yield None
            return
        session = ray._private.worker._global_node.get_session_dir_path()
        ray_yml = pathlib.Path(session, "metrics", "prometheus", "prometheus.yml")
        wait_for(ray_yml.exists, 60, f"Ray to write {ray_yml}")
        sd_files = yaml.safe_load(ray_yml.read_text())["scrape_configs"][0]["file_sd_configs"][0]["files"]
        wait_for(lambda: all(pathlib.Path(f).exists() for f in sd_files), 60, f"Ray to write {sd_files}")
        assert all(f.startswith(session) for f in sd_files), sd_files  # this cluster's nodes, not another Ray's
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": "ray",
                                      "file_sd_configs": [{"files": sd_files, "refresh_interval": "5s"}]}]}
        with running_prometheus(work, config) as port:
            yield port
    finally:
        ray.shutdown()


def check_board(port: int, cfg, summary: dict, started: float, end: float, board_exprs: list[str]) -> None:
    """Every query of the board over the run (`started` to `end`) returns finite series for every region, with
    plausible values; the byte counters are exactly the summary's."""
    name = cfg.run.name
    for expr in board_exprs:
        query = expr.replace("$run", name).replace("$region", ".*").replace("$__rate_interval", "30s")
        query = query.replace("$__range", f"{int(end - started) + 60}s")
        result = api(port, "query_range", query=query, start=started, end=end, step="1s")["result"]
        assert result, f"no series for {query}"
        values = {tuple(sorted(s["metric"].items())): [float(v) for _, v in s["values"]] for s in result}
        assert all(math.isfinite(v) for vs in values.values() for v in vs), query
        if "by (region" in query:
            assert {s["metric"]["region"] for s in result} == {r.name for r in cfg.regions}, (query, result)
        check_plausible(query, result, summary, cfg)
    # The counters themselves (the board reads them through increase()): exactly what the summary says.
    for key, metric in (("comm_bytes_sent", "bytes_sent_total"), ("comm_bytes_received", "bytes_received_total")):
        result = api(port, "query", query=f'ray_ray_diloco_{metric}{{run="{name}"}}', time=end)["result"]
        assert {s["metric"]["region"]: float(s["value"][1]) for s in result} == \
            {r: float(b) for r, b in summary[key].items()}, (metric, result)
