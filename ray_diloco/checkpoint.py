"""Outer-state checkpoints of a region: complete or absent.

A checkpoint is a directory `outer-NNNNNN/` holding θ_global, the outer momentum and the outer step. It is
written under a temporary name, flushed to disk, then renamed in one step: a process killed while writing
leaves a stray `.tmp-*` directory that is never read, and the previous checkpoint stays the latest.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

import torch

_NAME = re.compile(r"^outer-(\d{6,})$")
STATE_FILE = "outer_state.pt"


def checkpoint_dir(run_dir: str | Path, region: str) -> Path:
    return Path(run_dir) / "checkpoints" / region


def save_outer_checkpoint(root: str | Path, outer_step: int, theta: dict[str, torch.Tensor],
                          momentum: dict[str, torch.Tensor], keep: int = 2) -> Path:
    """Write `root/outer-<step>/` atomically; keep the newest `keep` checkpoints."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"outer-{outer_step:06d}"
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    path = tmp / STATE_FILE
    torch.save({"outer_step": outer_step, "theta": theta, "momentum": momentum}, path)
    with open(path, "rb") as handle:  # the bytes are on disk before the name says "complete"
        os.fsync(handle.fileno())
    if final.exists():  # the same step written again (e.g. after a restart): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (temporary directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(root: str | Path) -> Path | None:
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def load_outer_checkpoint(path: str | Path) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{path}: not an outer checkpoint (no {STATE_FILE}); give a directory "
                                "outer-NNNNNN/ under <run>/checkpoints/<region>/")
    state = torch.load(file, map_location="cpu", weights_only=True)
    return state["outer_step"], state["theta"], state["momentum"]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
