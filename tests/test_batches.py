"""A region's batch stream: batch i is the same windows whoever asks and however often, so a group of any
worker count continues from the region's position with no window twice and none skipped; the fingerprint tells
two streams apart when one saw a window twice or skipped one; data with no batch at all fails with an error that
says why (not a bare StopIteration)."""

import gc
import os

import numpy as np
import pytest
import ray
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_diloco.batches import START, WorkerBatches, region_progress, window_fingerprint
from ray_diloco.data.stream import PositionalReader, RegionStream


def windows(n, seq_len=4):
    return np.arange(n * seq_len, dtype=np.int32).reshape(n, seq_len)


def test_fingerprint_is_order_independent_and_sees_repeats_and_gaps():
    data = windows(6)
    reference = window_fingerprint(data)
    assert window_fingerprint(data[::-1]) == reference
    assert (window_fingerprint(data[:3]) + window_fingerprint(data[3:])) % 2**64 == reference
    repeated = np.concatenate([data[:5], data[:1]])  # window 0 twice, window 5 never: same count
    assert window_fingerprint(repeated) != reference


def epoch_of(data, batch_size):
    """One epoch of `data` in batches (drop_last), as Ray Data gives them."""
    return lambda: iter([data[i:i + batch_size] for i in range(0, len(data) - batch_size + 1, batch_size)])


def no_batch():
    return RuntimeError("no training windows")


# Batch i of the endless stream of 10 windows in batches of 3 (3 batches per epoch, window 9 dropped).
def expected_batch(i):
    return windows(10)[(i % 3) * 3:(i % 3) * 3 + 3]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=30))
def test_the_reader_gives_batch_i_whatever_the_order_of_requests(requests):
    """Requests in any order (ranks ahead, behind, a restarted group going back): always batch i, its epoch and
    its place in the epoch."""
    reader = PositionalReader(epoch_of(windows(10), 3), no_batch)
    for index in requests:
        batch, epoch, epoch_batches = reader.take(index)
        assert batch.tolist() == expected_batch(index).tolist()
        assert (epoch, epoch_batches) == (index // 3, index % 3 + 1)


def test_a_rewind_starts_at_the_anchor_epoch_not_at_the_beginning():
    epochs_started = []

    def new_epoch():
        epochs_started.append(1)
        return epoch_of(windows(10), 3)()

    reader = PositionalReader(new_epoch, no_batch)
    for index in range(8):
        reader.take(index)
    started = len(epochs_started)  # epochs 0, 1, 2
    anchor = {"batches": 7, "epoch": 2, "epoch_batches": 1}  # the group restarts after batch 6
    assert reader.take(7, anchor)[0].tolist() == expected_batch(7).tolist()
    assert len(epochs_started) == started + 1 and reader.rewinds == 1  # epoch 2 once more, not 0, 1, 2


def test_data_without_a_batch_fails_with_the_readers_error():
    reader = PositionalReader(lambda: iter([]), no_batch)
    with pytest.raises(RuntimeError, match="no training windows"):
        reader.take(0)


def test_region_progress_adds_the_ranks_windows_to_the_start():
    start = {**START, "batches": 4, "epoch": 1, "epoch_batches": 1, "windows": 12,
             "fingerprint": f"{window_fingerprint(windows(3)):016x}"}
    ranks = [{"batches": 7, "epoch": 2, "epoch_batches": 1, "windows": 3, "start": start,
              "fingerprint": f"{window_fingerprint(windows(5)[3:4]):016x}"},
             {"batches": 6, "epoch": 1, "epoch_batches": 3, "windows": 1, "start": start,
              "fingerprint": f"{window_fingerprint(windows(5)[4:]):016x}"}]
    got = region_progress(ranks)
    assert got == {"batches": 7, "epoch": 2, "epoch_batches": 1, "windows": 16,
                   "fingerprint": f"{window_fingerprint(windows(5)):016x}"}


@pytest.fixture(scope="module")
def ray_for_data():
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # never join another run's cluster
    yield
    ray.shutdown()


def train_group(stream, world_size, steps, start):
    """A group of `world_size` ranks in lockstep for `steps` steps: the windows each took, the region position."""
    ranks = [WorkerBatches(stream, "cpu", rank, world_size, start) for rank in range(world_size)]
    taken = [rank.next() for _ in range(steps) for rank in ranks]
    return taken, region_progress([rank.progress() for rank in ranks])


def test_groups_of_other_sizes_continue_the_regions_stream_exactly(ray_for_data):
    """2 workers for 2 steps, then 1 worker for 3 steps (a scale-in), then 2 again (a scale-out): the windows
    trained are the region's first 9 batches, across epochs, and the fingerprint says so."""
    ds = ray.data.from_numpy(windows(10)).rename_columns({"data": "input_ids"})
    stream = RegionStream.remote(lambda: ds, 3)
    trained, position = [], None
    for world_size, steps in ((2, 2), (1, 3), (2, 1)):
        taken, position = train_group(stream, world_size, steps, position)
        trained += taken
    want = [expected_batch(i) for i in range(9)]
    assert sorted(t.tolist() for t in trained) == sorted(w.tolist() for w in want)
    assert position["batches"] == 9 and (position["epoch"], position["epoch_batches"]) == (2, 3)
    assert position["windows"] == 27
    assert position["fingerprint"] == f"{sum(window_fingerprint(w) for w in want) % 2**64:016x}"
    # A group that died after its steps restarts from the last completed position: it gets those batches again.
    again, _ = train_group(stream, 2, 1, {**position, "batches": 7, "epoch": 2, "epoch_batches": 1,
                                         "windows": 21})
    assert sorted(t.tolist() for t in again) == sorted(expected_batch(i).tolist() for i in (7, 8))
    ray.kill(stream)
    gc.collect()


def test_an_empty_dataset_error_gives_the_skipped_count(ray_for_data):
    from ray_diloco.actor_by_name import ActorByName
    from ray_diloco.data.pipeline import DataCounters

    counters = DataCounters.options(name="counters-of-an-empty-dataset").remote()
    ray.get(counters.add.remote(b"batch", 7, 0, 0, 0))
    ds = ray.data.from_numpy(windows(2)).rename_columns({"data": "input_ids"})  # fewer windows than a batch
    # By name, as the driver hands them over: the stream looks the counters up when it needs the count.
    stream = RegionStream.remote(lambda: ds, 3, ActorByName("counters-of-an-empty-dataset"))
    batches = WorkerBatches(stream, "cpu", 0, 1)
    with pytest.raises(RuntimeError, match=r"no training windows .* no batch of 3 windows; check data.path.*7 rec"):
        batches.next()
    ray.kill(counters)
    ray.kill(stream)


def test_a_failed_dataset_build_fails_that_call_and_the_stream_builds_it_at_the_next(ray_for_data, tmp_path):
    """Built on first use, not in the constructor (Ray never restarts an actor whose constructor raised)."""
    ds = ray.data.from_numpy(windows(10)).rename_columns({"data": "input_ids"})
    marker = str(tmp_path / "failed-once")

    def fails_once():  # as a listing of S3 or the Hub can while a stream restarts (defined here: pickled by value)
        if not os.path.exists(marker):
            open(marker, "w").close()
            raise OSError("listing failed (a passing error)")
        return ds

    stream = RegionStream.remote(fails_once, 3)
    with pytest.raises(ray.exceptions.RayTaskError, match="listing failed"):
        ray.get(stream.prepare.remote())
    batch, epoch, read = ray.get(stream.take.remote(0))  # the same actor, alive, builds it now
    assert batch.tolist() == expected_batch(0).tolist() and (epoch, read) == (0, 1)
    ray.kill(stream)
