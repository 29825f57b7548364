"""The run's DataCounters reach its readers by name (`ray_diloco.actor_by_name`): the driver's log has no
"constructor arguments in the object store" ERROR line at every run start, and the counts still arrive (real
Ray, in a process of its own: the line is written by the driver process's core worker)."""

import pickle
import subprocess
import sys

from ray_diloco.actor_by_name import ActorByName

LINE = "has constructor arguments in the object store"

SCRIPT = """
import sys, ray
from ray_diloco.actor_by_name import ActorByName
from ray_diloco.config import ExperimentConfig
from ray_diloco.data import DataCounters, build_region_dataset
from ray_diloco.data.stream import RegionStream
from ray_diloco.driver import dataset_recipes, start_streams

ray.init(address="local", num_cpus=1, include_dashboard=False)
cfg = ExperimentConfig()
groups = cfg.regions[:1]
counters = DataCounters.options(name="counters").remote()
by_name = ActorByName("counters")
(stream,) = start_streams(cfg, groups, dataset_recipes(cfg, groups, by_name), by_name)  # as the driver does
batch, epoch, read = ray.get(stream.take.remote(0))
print("batch", tuple(batch.shape), "docs", ray.get(counters.get.remote())["docs"], flush=True)
# What the driver passed before: the built dataset and the counters' handle. After the run's streams: Ray logs the
# line once per process.
print("--- with the dataset and the handle", file=sys.stderr, flush=True)
dataset = build_region_dataset(cfg.data, dataset_recipes(cfg, groups, None)[0].args[1], counters)
with_handle = RegionStream.remote(lambda: dataset, cfg.data.batch_size, counters)
ray.get(with_handle.take.remote(0))
ray.shutdown()
"""


def test_a_stream_given_the_counters_by_name_counts_its_documents_without_ray_logging_an_error():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "batch (" in done.stdout, done.stdout
    assert int(done.stdout.split("docs ")[1].split()[0]) > 0, done.stdout  # the map tasks found the counters
    by_name, with_handle = done.stderr.split("--- with the dataset and the handle")
    assert LINE not in by_name, by_name[-3000:]
    assert LINE in with_handle, with_handle[-3000:]  # the check sees the line where Ray writes it


def test_it_pickles_as_its_name_and_namespace_and_looks_the_actor_up_again():
    ref = ActorByName("diloco-data-run", namespace="job-1")
    ref._handle = object()  # a handle looked up in this process never travels
    copy = pickle.loads(pickle.dumps(ref))
    assert (copy.name, copy.namespace, copy._handle) == ("diloco-data-run", "job-1", None)
