"""Shard layout: dim-0 shards of every rank assemble into the full tensor and split back exactly."""

import pytest
import torch

from ray_diloco.sharding import assemble, rows_for_rank, shard_rows


@pytest.mark.parametrize("rows, world", [(10, 3), (3, 4), (1, 2), (8, 8), (7, 1)])
def test_rows_partition_the_tensor_like_torch_chunk(rows, world):
    ranges = [shard_rows(rows, world, r) for r in range(world)]
    covered = [i for start, stop in ranges for i in range(start, stop)]
    assert covered == list(range(rows))
    chunks = torch.arange(rows).chunk(world)
    for rank, chunk in enumerate(chunks):
        assert ranges[rank] == (chunk[0].item(), chunk[-1].item() + 1)


def test_assemble_then_split_round_trips_and_rejects_missing_rows():
    full = {"w": torch.randn(5, 3), "b": torch.randn(2)}
    shapes = {k: v.shape for k, v in full.items()}
    shards = {r: rows_for_rank(full, 3, r) for r in range(3)}
    assert shards[2]["b"].shape == (0,)
    again = assemble(shards, shapes)
    for name, tensor in full.items():
        assert torch.equal(again[name], tensor)
    shards[1]["w"] = shards[1]["w"][:1]
    with pytest.raises(ValueError, match="assemble to"):
        assemble(shards, shapes)
    with pytest.raises(ValueError, match="ranks 0..1"):
        assemble({0: shards[0], 2: shards[2]}, shapes)


def test_the_wire_round_trips_bit_for_bit_through_a_read_only_buffer_without_a_warning():
    """Shards and rows travel worker <-> SyncActor as numpy arrays; Ray hands them back read-only."""
    import warnings

    import numpy as np

    from ray_diloco.sharding import from_wire, to_wire
    full = {"w": torch.randn(5, 3), "b": torch.tensor([float("nan"), -0.0, 1e-45])}
    wire = to_wire(full)
    assert all(isinstance(a, np.ndarray) for a in wire.values())
    assert np.shares_memory(wire["w"], full["w"].numpy())  # views: Ray copies when the call is made
    for array in wire.values():
        array.setflags(write=False)  # as Ray's object store gives them
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = from_wire(wire)
    for name, tensor in full.items():
        assert back[name].dtype == torch.float32
        assert back[name].view(torch.int32).equal(tensor.view(torch.int32))  # NaN and -0.0 too
    assert from_wire(full)["w"] is full["w"]  # torch tensors pass as they are


def test_ray_copies_the_arrays_of_a_call_when_it_is_made(local_ray):
    """`to_wire` passes views of live tensors (the worker's parameters, the SyncActor's θ_global): that is safe
    only because Ray serializes a call's arguments when `.remote()` returns, so a later in-place update is not
    what the receiver gets. Large enough to go through the object store (> 100 KiB)."""
    import ray

    from ray_diloco.sharding import to_wire

    @ray.remote
    def total(arrays) -> float:
        return float(sum(a.sum() for a in arrays.values()))

    live = {"w": torch.ones(512, 512)}
    pending = total.remote(to_wire(live))
    live["w"].add_(1.0)  # the next inner steps, or the next outer step
    assert ray.get(pending) == 512 * 512
