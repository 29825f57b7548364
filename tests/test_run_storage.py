"""Runs sharing a bucket keep apart, and a region has one driver at a time (`ray_diloco.run_storage`)."""

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from ray_diloco.checkpoint import CheckpointStore, OuterCheckpoint, join
from ray_diloco.config import ConfigError
from ray_diloco.presets import tiny_cpu
from ray_diloco.run_setup import prepare_run, training_groups
from ray_diloco.run_storage import LeaseHeld, RegionLease, claim_storage


def run_in(bucket, name, **fields):
    cfg = tiny_cpu()
    return dataclasses.replace(cfg.run, name=name, checkpoint_path=str(bucket), output_dir=str(bucket / "out"),
                               **fields)


def test_two_runs_in_one_bucket_neither_continue_nor_prune_each_other(tmp_path):
    a, b = run_in(tmp_path / "bucket", "a"), run_in(tmp_path / "bucket", "b")
    assert a.checkpoint_root() != b.checkpoint_root()
    assert a.checkpoint_root().startswith(a.storage() + "/") and b.checkpoint_root().startswith(b.storage() + "/")
    stores = {run.name: CheckpointStore(join(run.checkpoint_root(), "region-a"), keep=1) for run in (a, b)}
    theta = {"w": torch.zeros(2)}
    stores["a"].save(OuterCheckpoint(outer_step=3, theta=theta, momentum={}))
    for step in (1, 2):  # b's pruning keeps one checkpoint: its own
        stores["b"].save(OuterCheckpoint(outer_step=step, theta=theta, momentum={}))
    assert stores["a"].steps() == [3] and stores["b"].steps() == [2]


def test_storage_that_holds_another_run_is_refused_in_one_line(tmp_path):
    bucket = tmp_path / "bucket"
    claim_storage(run_in(bucket, "a"))
    claim_storage(run_in(bucket, "a"))  # the same run again: continues
    assert (bucket / "a" / "RUN").read_text() == "a\n"
    # A --checkpoint-path pointing inside run a: run b would live among a's files.
    with pytest.raises(ConfigError, match=r"^--checkpoint-path: .*storage of run 'a'") as inside:
        claim_storage(run_in(bucket / "a", "b"))
    assert "\n" not in str(inside.value)
    with pytest.raises(ConfigError, match=r"^--checkpoint-path: .*storage of run 'a'"):  # said before anything starts
        prepare_run(dataclasses.replace(tiny_cpu(), run=run_in(bucket / "a", "b")), training_groups(tiny_cpu()))
    os.rename(bucket / "a", bucket / "c")  # a run's directory renamed by hand
    with pytest.raises(ConfigError, match=r"^--run-name c: .* holds run 'a'"):
        claim_storage(run_in(bucket, "c"))


def test_storage_under_a_file_is_refused_naming_the_file(tmp_path):
    """It was "cannot read …/RUN ([Errno 20] … Not a directory)" (a new user's --output-dir that was a file)."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    for bucket in (afile, afile / "deeper"):
        with pytest.raises(ConfigError, match=rf"^--checkpoint-path: {afile} is a file, not a directory; give a "
                                              r"directory \(made where missing\)$"):
            claim_storage(run_in(bucket, "a"))
    results_only = dataclasses.replace(run_in(tmp_path, "a"), checkpoint_path=None, output_dir=str(afile))
    with pytest.raises(ConfigError, match=rf"^--output-dir: {afile} is a file, not a directory"):
        claim_storage(results_only)


def test_a_second_driver_is_refused_while_the_first_renews_and_starts_once_it_released(tmp_path):
    first = RegionLease(str(tmp_path), "eu", period=0.2)
    assert first.acquire() is False
    second = RegionLease(str(tmp_path), "eu", period=0.2)
    started = time.monotonic()
    with pytest.raises(LeaseHeld, match=r"^region eu is run by another driver \(.* pid \d+"):
        second.acquire()
    assert time.monotonic() - started < 0.6 * 3  # refused at the first renewal it saw, not after a lapse
    first.release()
    assert not (tmp_path / "eu.json").exists()
    assert second.acquire() is False  # nothing held it: it starts at once
    second.release()
    # A driver that finds a lease released before its next renewal starts then, and says it waited (the driver
    # reads its resume plan again: the holder may have committed meanwhile).
    slow = RegionLease(str(tmp_path), "eu", period=5.0)
    slow.acquire()
    third = RegionLease(str(tmp_path), "eu", period=0.2)
    releasing = threading.Timer(0.5, slow.release)
    releasing.start()
    assert third.acquire() is True
    releasing.join()
    assert third.current().holder == third.lease.holder
    third.release()


HOLDER = """
import sys, time
from ray_diloco.run_storage import RegionLease
RegionLease(sys.argv[1], "eu", period=0.2).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_a_lease_whose_driver_was_killed_is_taken_over_after_it_lapsed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # no release: its lease stays in storage, renewed no more
        holder.wait()
    taker = RegionLease(str(tmp_path), "eu", period=0.2)
    started = time.monotonic()
    assert taker.acquire() is True
    assert time.monotonic() - started >= 3 * 0.2 * 0.9  # it waited for the lapse
    assert taker.current().holder == taker.lease.holder
    taker.release()


def test_a_holder_whose_lease_was_taken_over_is_told_once(tmp_path):
    lost = []
    told = threading.Event()
    holder = RegionLease(str(tmp_path), "eu", on_lost=lambda region: (lost.append(region), told.set()), period=0.1)
    holder.acquire()
    intruder = RegionLease(str(tmp_path), "eu", period=0.1)
    intruder._write()  # as a driver that found no lease in the same instant would
    assert told.wait(2.0)
    time.sleep(0.3)
    assert lost == ["eu"]
    holder.release()  # not its lease any more: left in place
    assert intruder.current().holder == intruder.lease.holder
