"""Outer checkpoints are complete or absent: a process killed while writing leaves the previous one loadable."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ray_diloco.checkpoint import complete_checkpoints, latest_checkpoint, load_outer_checkpoint, save_outer_checkpoint

WRITER = """
import sys, torch
from ray_diloco.checkpoint import save_outer_checkpoint
big = {"w": torch.ones(120_000_000)}  # ~480 MB: long enough a write to be killed in the middle
save_outer_checkpoint(sys.argv[1], 2, big, big)
"""


def test_save_load_round_trip_and_pruning(tmp_path):
    theta, momentum = {"w": torch.randn(3, 2)}, {"w": torch.randn(3, 2)}
    for step in (1, 2, 3):
        save_outer_checkpoint(tmp_path, step, theta, momentum, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["outer-000002", "outer-000003"]
    step, theta2, momentum2 = load_outer_checkpoint(latest_checkpoint(tmp_path))
    assert step == 3 and torch.equal(theta2["w"], theta["w"]) and torch.equal(momentum2["w"], momentum["w"])
    with pytest.raises(FileNotFoundError, match="not an outer checkpoint"):
        load_outer_checkpoint(tmp_path / "nothing")


def test_killed_while_writing_leaves_the_previous_checkpoint(tmp_path):
    theta = {"w": torch.arange(6.0)}
    save_outer_checkpoint(tmp_path, 1, theta, {})
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".tmp-outer-000002") for p in tmp_path.iterdir()):
        assert writer.poll() is None, "the writer finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)  # inside torch.save of ~480 MB
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    assert not (tmp_path / "outer-000002").exists(), "the kill came after the write completed; test is void"
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "outer-000001"
    step, loaded, _ = load_outer_checkpoint(latest)
    assert step == 1 and torch.equal(loaded["w"], theta["w"])
