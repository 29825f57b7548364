"""Outer checkpoints are complete or absent: a process killed while writing leaves the previous one loadable.

The store goes through `pyarrow.fs`, the same code for local paths and s3:// / gs:// URIs; here it runs on
the local disk, by path and by `file://` URI (no cloud bucket is reachable from the test machines).
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ray_diloco.checkpoint import (
    MARKER,
    CheckpointStore,
    OuterCheckpoint,
    load_outer_checkpoint,
)

WRITER = """
import sys, torch
from ray_diloco.checkpoint import CheckpointStore, OuterCheckpoint
big = {"w": torch.ones(120_000_000)}  # ~480 MB: long enough a write to be killed in the middle
CheckpointStore(sys.argv[1]).save(OuterCheckpoint(outer_step=2, theta=big, momentum=big))
"""


def checkpoint(step, theta, momentum=None, **fields):
    return OuterCheckpoint(outer_step=step, theta=theta, momentum=momentum or {}, **fields)


@pytest.mark.parametrize("as_uri", [False, True], ids=["path", "file-uri"])
def test_save_load_round_trip_and_pruning(tmp_path, as_uri):
    root = f"file://{tmp_path}/region" if as_uri else str(tmp_path / "region")
    store = CheckpointStore(root, keep=2)
    theta, momentum = {"w": torch.randn(3, 2)}, {"w": torch.randn(3, 2)}
    progress = {"batches": 6, "epoch": 0, "epoch_batches": 6, "windows": 48, "fingerprint": "00ff"}
    for step in (1, 2, 3):
        store.save(checkpoint(step, theta, momentum, progress=progress, worker_checkpoint=f"w/{step}",
                              tokens=100 * step, config_yaml="run: {}\n"))
    assert store.steps() == [2, 3]
    assert sorted(os.listdir(tmp_path / "region")) == ["outer-000002", "outer-000003"]
    loaded = store.load()
    assert loaded.outer_step == 3 and loaded.worker_checkpoint == "w/3" and loaded.tokens == 300
    assert torch.equal(loaded.theta["w"], theta["w"]) and torch.equal(loaded.momentum["w"], momentum["w"])
    assert loaded.progress == progress and loaded.config_yaml == "run: {}\n"
    assert load_outer_checkpoint(store.location(2)).outer_step == 2
    with pytest.raises(FileNotFoundError, match="no committed outer checkpoint of step 1"):
        store.load(1)
    with pytest.raises(FileNotFoundError, match="not a committed outer checkpoint"):
        load_outer_checkpoint(str(tmp_path / "nothing"))


def test_a_home_relative_root_resolves_like_a_data_path(tmp_path, monkeypatch):
    # The store resolves its root with data.files.resolve_filesystem: "~" is the home directory (the
    # checkpoint module's own resolver made it a directory named "~" under the working directory).
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    CheckpointStore("~/region").save(checkpoint(1, {"w": torch.zeros(2)}))
    assert (tmp_path / "home" / "region" / "outer-000001" / MARKER).exists()
    assert not (tmp_path / "~").exists()


def test_a_directory_without_its_marker_is_not_a_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(checkpoint(1, {"w": torch.zeros(2)}))
    store.save(checkpoint(2, {"w": torch.ones(2)}))
    os.remove(tmp_path / "outer-000002" / MARKER)  # as if the writer died just before the marker
    assert store.latest_step() == 1
    assert torch.equal(store.load().theta["w"], torch.zeros(2))


def test_killed_while_writing_leaves_the_previous_checkpoint(tmp_path):
    theta = {"w": torch.arange(6.0)}
    CheckpointStore(str(tmp_path)).save(checkpoint(1, theta))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    state_file = tmp_path / "outer-000002" / "outer_state.pt"
    deadline = time.monotonic() + 120
    while not (state_file.exists() and state_file.stat().st_size > 0):
        assert writer.poll() is None, "the writer finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(writer.pid, signal.SIGKILL)  # inside the write of ~480 MB
    writer.wait()
    assert not (tmp_path / "outer-000002" / MARKER).exists(), "the kill came after the commit; test is void"
    store = CheckpointStore(str(tmp_path))
    assert store.steps() == [1]
    loaded = store.load()
    assert loaded.outer_step == 1 and torch.equal(loaded.theta["w"], theta["w"])
