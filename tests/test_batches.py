"""A worker's batch stream: a resumed stream continues with exactly the next window, the fingerprint
tells two streams apart when one saw a window twice or skipped one, and a shard with no batch at all
fails with an error that says why (not a bare StopIteration)."""

import gc

import numpy as np
import pytest
import ray

from ray_diloco.batches import WorkerBatches, combine_progress, window_fingerprint


def windows(n, seq_len=4):
    return np.arange(n * seq_len, dtype=np.int32).reshape(n, seq_len)


def test_fingerprint_is_order_independent_and_sees_repeats_and_gaps():
    data = windows(6)
    reference = window_fingerprint(data)
    assert window_fingerprint(data[::-1]) == reference
    assert (window_fingerprint(data[:3]) + window_fingerprint(data[3:])) % 2**64 == reference
    repeated = np.concatenate([data[:5], data[:1]])  # window 0 twice, window 5 never: same count
    assert window_fingerprint(repeated) != reference


def test_combine_progress_adds_windows_and_hashes():
    a = {"windows": 2, "fingerprint": f"{window_fingerprint(windows(2)):016x}"}
    b = {"windows": 3, "fingerprint": f"{window_fingerprint(windows(5)[2:]):016x}"}
    assert combine_progress([a, b]) == {"windows": 5, "fingerprint": f"{window_fingerprint(windows(5)):016x}"}


@pytest.fixture(scope="module")
def ray_for_data():
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # never join another run's cluster
    yield
    ray.shutdown()


def test_a_resumed_stream_goes_on_with_the_next_window_across_epochs(ray_for_data):
    ds = ray.data.from_numpy(windows(10)).rename_columns({"data": "input_ids"})
    ds.context.execution_options.preserve_order = True
    straight = WorkerBatches(ds, batch_size=3, device="cpu", world_size=1)
    seen = [straight.next() for _ in range(7)]  # 3 batches per epoch (drop_last): epochs 0, 1, 2

    stopped = WorkerBatches(ds, batch_size=3, device="cpu", world_size=1)
    for _ in range(4):
        stopped.next()
    resumed = WorkerBatches(ds, batch_size=3, device="cpu", world_size=1, progress=stopped.progress())
    rest = [resumed.next() for _ in range(3)]

    for got, want in zip(rest, seen[4:]):
        assert got.dtype.is_floating_point is False and got.tolist() == want.tolist()
    assert resumed.progress() == straight.progress()
    assert straight.progress()["epoch"] == 2 and straight.progress()["windows"] == 21
    with pytest.raises(ValueError, match="same number of workers"):
        WorkerBatches(ds, batch_size=3, device="cpu", world_size=2, progress=stopped.progress())
    del straight, stopped, resumed  # close the streams while Ray is still up
    gc.collect()


class EmptyShard:
    """A dataset shard whose every epoch yields nothing (all records skipped, or fewer windows than a batch)."""

    def iter_batches(self, **kwargs):
        return iter([])


def test_an_empty_shard_fails_with_a_clear_error():
    batches = WorkerBatches(EmptyShard(), batch_size=3, device="cpu", world_size=1)
    with pytest.raises(RuntimeError, match=r"no training windows .* no batch of 3 windows; check data.path"):
        batches.next()


def test_the_empty_shard_error_gives_the_skipped_count(ray_for_data):
    from ray_diloco.data.pipeline import DataCounters

    counters = DataCounters.remote()
    ray.get(counters.add.remote(b"batch", 7, 0, 0, 0))
    batches = WorkerBatches(EmptyShard(), batch_size=3, device="cpu", world_size=1, counters=counters)
    with pytest.raises(RuntimeError, match="7 record"):
        batches.next()
    ray.kill(counters)
