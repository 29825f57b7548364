"""What outlives a region's driver: its last committed and its final outer state, kept in the run's storage.

With one Ray cluster per region, a region's driver ends on its own: a region that finished the run alone (the
others were late) exits, and its DHT record goes with it (a tombstone at shutdown, or expiry). A region that
arrives later would then see no records, run its round alone and finish on another θ_global, with nothing to say
so. So every region also keeps, in the storage all clusters of the run share (`run.states_dir()`, beside the
peer files), one small record per region, `<region>.json`: its outer step, the digest of θ_global, its phase and
where the state behind it lies:
- after each committed checkpoint: that checkpoint (phase training; a region starting later joins from it);
- when it finishes: its final state, written to `<region>/outer-NNNNNN/` in the checkpoint format, record last.
The membership reads these beside the DHT records: a region's live record wins over its stored one, and a stored
final record is the state of a region that can no longer change (`policy.with_stored`). Loading a stored state
checks its digest before it is used.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass

import pyarrow.fs as pafs
import torch

from ray_diloco.checkpoint import CheckpointStore, OuterCheckpoint, join, load_outer_checkpoint
from ray_diloco.data.files import resolve_filesystem
from ray_diloco.sync.outer import state_digest
from ray_diloco.sync.policy import FINISHED, StateRecord, parse_record

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredRecord:
    record: StateRecord  # as the region published it
    location: str  # a committed outer checkpoint directory holding θ_global, momentum and outer step


def write_atomically(directory: str, name: str, payload: bytes) -> str:
    """Write (replace) `<directory>/<name>` so that readers see the old file or the new one, never half of one.
    Returns the file's location."""
    fs, path = resolve_filesystem(directory)
    fs.create_dir(path, recursive=True)
    target = join(path, name)
    if isinstance(fs, pafs.LocalFileSystem):  # write aside, then rename
        # A name of its own per writer: two drivers writing the same file at once (the run's RUN marker) must not
        # rename each other's half-written file away.
        temporary = join(path, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        with fs.open_output_stream(temporary) as stream:
            stream.write(payload)
        fs.move(temporary, target)
    else:  # object stores make an object visible only once its upload completed
        with fs.open_output_stream(target) as stream:
            stream.write(payload)
    return join(directory, name)


def write_record(directory: str, stored: StoredRecord) -> str:
    record = stored.record
    value = {"outer_step": record.outer_step, "digest": record.digest, "group_size": record.group_size,
             "phase": record.phase, "location": stored.location, "momentum_digest": record.momentum_digest}
    return write_atomically(directory, f"{record.region}.json", json.dumps(value).encode())


def read_records(directory: str) -> dict[str, StoredRecord]:
    """Every region's stored record; unreadable or malformed files are logged and skipped."""
    fs, path = resolve_filesystem(directory)
    found: dict[str, StoredRecord] = {}
    for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        if info.type != pafs.FileType.File or not info.base_name.endswith(".json"):
            continue
        region = info.base_name[:-len(".json")]
        try:
            with fs.open_input_stream(info.path) as stream:
                value = json.loads(stream.read())
            found[region] = StoredRecord(parse_record(region, {**value, "waited": 0.0}),
                                         str(value["location"]))
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("skipping the stored state record %s: %r", info.path, error)
    return found


def save_final_state(directory: str, region: str, step: int, theta: dict[str, torch.Tensor],
                     momentum: dict[str, torch.Tensor], config_yaml: str) -> str:
    """The state a region finished with, as a committed checkpoint under `<directory>/<region>/`. Returns where."""
    store = CheckpointStore(join(directory, region), keep=1)
    return store.save(OuterCheckpoint(outer_step=step, theta=theta, momentum=momentum, config_yaml=config_yaml))


def finished(stored: StoredRecord, target: int) -> bool:
    """The region finished this run (`target` outer steps; a run continued with more steps is not finished at
    the old end): its state can no longer change."""
    return stored.record.phase == FINISHED and stored.record.outer_step >= target


def load_state(stored: StoredRecord, shapes: dict[str, torch.Size]
               ) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(outer step, θ_global, momentum) behind `stored`, checked against the record (step, digest) and the
    model's own parameter shapes. Raises ValueError when it does not match, OSError when it cannot be read."""
    checkpoint = load_outer_checkpoint(stored.location)
    expected = {name: tuple(shape) for name, shape in shapes.items()}
    theta = {name: tuple(t.shape) for name, t in checkpoint.theta.items()}
    momentum = {name: tuple(t.shape) for name, t in checkpoint.momentum.items()}  # absent before the first step
    if theta != expected or any(expected.get(name) != shape for name, shape in momentum.items()):
        raise ValueError(f"{stored.location}: its θ_global or momentum does not have this model's parameters "
                         "and shapes")
    digest = state_digest(checkpoint.theta)
    if (checkpoint.outer_step, digest) != (stored.record.outer_step, stored.record.digest):
        raise ValueError(f"{stored.location} holds outer step {checkpoint.outer_step} with digest {digest}, but "
                         f"the record says {stored.record.outer_step} / {stored.record.digest}")
    if stored.record.momentum_digest and state_digest(checkpoint.momentum) != stored.record.momentum_digest:
        raise ValueError(f"{stored.location}: its momentum does not match the record's momentum digest")
    return checkpoint.outer_step, checkpoint.theta, checkpoint.momentum
