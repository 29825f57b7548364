"""Outer-state checkpoints of a region: complete or absent, on local disk or object storage.

A checkpoint is a directory `outer-NNNNNN/` holding `outer_state.pt` (θ_global, outer momentum, outer step,
the region's data progress, the name of the matching worker checkpoint and a compressed method's state), the run's `config.yaml`, and
last a `COMMITTED` marker. Readers only see directories with the marker, so a process killed while writing
leaves the previous checkpoint the latest — on a local disk (data fsync'd before the marker) and on S3/GCS
(an object becomes visible only once its upload completes) alike, through the same `pyarrow.fs` code.

The marker is written only after the region's workers have uploaded their Ray Train checkpoint of the same
outer step, so a committed outer checkpoint also vouches that the worker checkpoint it names is complete.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs
import torch

# The same resolution as the data files: a local path, or an s3:// gs:// file:// URI.
from ray_diloco.data.files import resolve_filesystem
from ray_diloco.uris import join

_NAME = re.compile(r"^outer-(\d{6,})$")
STATE_FILE = "outer_state.pt"
CONFIG_FILE = "config.yaml"
MARKER = "COMMITTED"


@dataclass
class OuterCheckpoint:
    outer_step: int
    theta: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    # The region's data position (`batches.region_progress`): what its workers have consumed so far.
    progress: dict[str, Any] | None = None
    worker_checkpoint: str | None = None
    tokens: int = 0  # trained by the region so far
    short_tokens: int = 0  # one worker's tokens short of whole windows so far (SyncActorImpl.short_tokens)
    config_yaml: str = ""
    # A compressed outer method's state of this region (error feedback / momentum, ray_diloco.methods): its own,
    # not shared with the other regions; empty for DiLoCo.
    method_state: dict[str, torch.Tensor] = field(default_factory=dict)


class CheckpointStore:
    """The outer checkpoints of one region under `root` (a local path or a URI)."""

    keep_default = 2  # committed checkpoints kept per region (the workers' are kept to match: driver.py)

    def __init__(self, root: str, keep: int = keep_default):
        self.root = root
        self.fs, self.path = resolve_filesystem(root)
        self.keep = keep
        self._local = isinstance(self.fs, pafs.LocalFileSystem)

    def steps(self) -> list[int]:
        """Outer steps with a committed checkpoint, oldest first."""
        selector = pafs.FileSelector(self.path, allow_not_found=True)
        found = []
        for info in self.fs.get_file_info(selector):
            match = _NAME.match(info.base_name)
            if match and info.type == pafs.FileType.Directory and self._exists(join(info.path, MARKER)):
                found.append(int(match.group(1)))
        return sorted(found)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def location(self, step: int) -> str:
        return join(self.root, f"outer-{step:06d}")

    def save(self, checkpoint: OuterCheckpoint) -> str:
        """Write the checkpoint, then its marker; prune all but the newest `keep` committed ones."""
        directory = join(self.path, f"outer-{checkpoint.outer_step:06d}")
        self._delete(directory)  # the same step written again (after a restart): start clean
        self.fs.create_dir(directory, recursive=True)
        state = {"outer_step": checkpoint.outer_step, "theta": checkpoint.theta, "momentum": checkpoint.momentum,
                 "progress": checkpoint.progress, "worker_checkpoint": checkpoint.worker_checkpoint,
                 "tokens": checkpoint.tokens, "short_tokens": checkpoint.short_tokens,
                 "method_state": checkpoint.method_state}
        self._write(join(directory, STATE_FILE), lambda handle: torch.save(state, handle))
        self._write(join(directory, CONFIG_FILE), lambda handle: handle.write(checkpoint.config_yaml.encode()))
        marker = json.dumps({"outer_step": checkpoint.outer_step}).encode()
        self._write(join(directory, MARKER), lambda handle: handle.write(marker))
        for old in self.steps()[:-self.keep]:
            self._delete(join(self.path, f"outer-{old:06d}"))
        return self.location(checkpoint.outer_step)

    def load(self, step: int | None = None) -> OuterCheckpoint:
        """The checkpoint of `step` (default: the latest committed one)."""
        steps = self.steps()  # one listing of the store
        if step is None and steps:
            step = steps[-1]
        if step is None or step not in steps:
            raise FileNotFoundError(f"no committed outer checkpoint{'' if step is None else f' of step {step}'} "
                                    f"under {self.root}; was the run started with run.checkpoint_every > 0?")
        return load_outer_checkpoint(self.location(step))

    def _write(self, path: str, write: Callable[[Any], Any]) -> None:
        """`write(handle)` streams the file (no second copy of θ in memory)."""
        if self._local:  # the bytes reach the disk before the marker that says "complete" is written
            with open(path, "wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
            return
        with self.fs.open_output_stream(path) as stream:  # visible only once the upload completes
            write(stream)

    def _exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def _delete(self, directory: str) -> None:
        if self._exists(directory):
            self.fs.delete_dir(directory)


def load_outer_checkpoint(location: str) -> OuterCheckpoint:
    """A committed `outer-NNNNNN` directory (local path or URI)."""
    fs, path = resolve_filesystem(location)
    if fs.get_file_info(join(path, MARKER)).type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{location}: not a committed outer checkpoint (no {MARKER} marker); give a "
                                "directory outer-NNNNNN/ under <checkpoints>/<region>/")
    with fs.open_input_file(join(path, STATE_FILE)) as handle:
        state = torch.load(io.BytesIO(handle.read()), map_location="cpu", weights_only=True)
    with fs.open_input_file(join(path, CONFIG_FILE)) as handle:
        config_yaml = handle.read().decode()
    return OuterCheckpoint(outer_step=state["outer_step"], theta=state["theta"], momentum=state["momentum"],
                           progress=state["progress"], worker_checkpoint=state["worker_checkpoint"],
                           tokens=state["tokens"], config_yaml=config_yaml,
                           short_tokens=state.get("short_tokens", 0),  # absent before it was kept: whole windows
                           method_state=state.get("method_state", {}))  # absent before compressed methods
