"""The run's storage belongs to the run, and each of its regions to one driver at a time.

Every cluster of a run shares one bucket (`run.checkpoint_path`, else `run.output_dir`), and everything the run
writes there lives under `<bucket>/<run>/` (`RunConfig.storage()`): checkpoints, peer files, stored states. Two
things keep runs and drivers apart in it:

- **The run marker** `<bucket>/<run>/RUN` names the run. A run refuses a storage directory whose marker names
  another run (a directory copied or renamed by hand), and a bucket that is itself a run's storage (a
  `--checkpoint-path` pointing inside a run: the new run would live among the old one's files).
- **A lease per region** (`<bucket>/<run>/leases/<region>.json`): the driver running a region holds it and renews
  it; a second driver for the same region (a resubmit while the old job drains, a KubeRay retry) refuses while the
  lease lives and takes it over once it has lapsed. Two drivers of one region would write the same peer file,
  DHT subkey and checkpoints, and `CheckpointStore.save` deletes a same-step directory before writing it.

No clock is shared: the holder's drivers may run on different hosts. A lease carries a counter, `beat`, that its
holder raises every `period` seconds; a reader decides from its own monotonic clock: a beat that moved is a live
holder, one that stood still for `lapse` seconds (three periods) is a lapsed one. A holder that ends releases the
lease (deletes it), so a resubmit after a clean end waits for nothing. Object stores have no compare-and-swap:
two drivers that find no lease in the same instant may both write one; each reads back what it wrote, and a
holder's next renewal that finds another holder's lease ends it (`on_lost`), so at most one driver holds the
region one period later.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from ray_diloco.uris import join
from ray_diloco.config import ConfigError, RunConfig
from ray_diloco.data.files import resolve_filesystem

logger = logging.getLogger(__name__)

MARKER = "RUN"
LEASE_PERIOD_SECONDS = 5.0  # a holder renews its lease this often
LAPSE_PERIODS = 3  # a lease not renewed for this many periods has lapsed


def _read(location: str) -> bytes | None:
    fs, path = resolve_filesystem(location)
    try:
        with fs.open_input_stream(path) as stream:
            return stream.read()
    except FileNotFoundError:
        return None


def check_run_storage(run: RunConfig) -> bool:
    """Refuse storage that holds another run (ConfigError: one line, exit 2), before anything starts. Returns
    whether the run's marker is there already (the run was started before)."""
    storage = run.storage()
    bucket = storage[: -len(run.name) - 1]  # storage() is `<bucket>/<name>`, the bucket normalised
    flag = "--checkpoint-path" if run.checkpoint_path else "--output-dir"
    if (blocking := file_in_the_way(storage)) is not None:
        raise ConfigError(f"{flag}: {blocking} is a file, not a directory; give a directory (made where missing)")
    try:
        other, owner = _read(join(bucket, MARKER)), _read(join(storage, MARKER))
    except OSError as error:  # an unreachable store or no access
        raise ConfigError(f"{flag}: cannot read {storage} ({str(error).splitlines()[0]})") from None
    if other is not None:
        raise ConfigError(f"{flag}: {bucket} is the storage of run {other.decode().strip()!r}, not a bucket; give "
                          "the directory that holds the runs (its parent)")
    if owner is not None and owner.decode().strip() != run.name:
        raise ConfigError(f"--run-name {run.name}: {storage} holds run {owner.decode().strip()!r} (its {MARKER} "
                          "file); choose another --run-name or --checkpoint-path")
    return owner is not None


def file_in_the_way(location: str) -> str | None:
    """The file, if any, where a local `location` or one of its parents should be a directory (None for URIs)."""
    if "://" in location:
        return None
    path = os.path.abspath(location)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return None if os.path.isdir(path) else path


def claim_storage(run: RunConfig) -> None:
    """`check_run_storage`, then mark the storage as the run's."""
    if not check_run_storage(run):
        _write(run.storage(), MARKER, f"{run.name}\n".encode())


def _write(directory: str, name: str, payload: bytes) -> None:
    # Imported here: the CLI checks the storage before torch (which durable imports) is loaded.
    from ray_diloco.sync.durable import write_atomically

    write_atomically(directory, name, payload)


@dataclass(frozen=True)
class Lease:
    holder: str  # a fresh id per driver
    who: str  # host and process, for the message a refused driver prints
    beat: int
    period: float


class LeaseHeld(ConfigError):
    """Another driver runs this region now."""


class RegionLease:
    """This driver's lease on one region (see the module docstring). `acquire()`, then `release()` at the end;
    `on_lost(region)` is called (once, from the renewing thread) if another driver's lease replaced ours."""

    def __init__(self, directory: str, region: str, on_lost: Callable[[str], None] | None = None,
                 period: float = LEASE_PERIOD_SECONDS):
        self.directory, self.region, self.period = directory, region, period
        self.on_lost = on_lost
        self.lease = Lease(uuid.uuid4().hex, f"{socket.gethostname()} pid {os.getpid()}", 0, period)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> Lease | None:
        """The lease in storage; an unreadable one counts as none (logged): it cannot prove a live holder."""
        raw = _read(join(self.directory, f"{self.region}.json"))
        if raw is None:
            return None
        try:
            value = json.loads(raw)
            return Lease(str(value["holder"]), str(value["who"]), int(value["beat"]), float(value["period"]))
        except (ValueError, KeyError, TypeError) as error:
            logger.warning("region %s: ignoring an unreadable lease (%r)", self.region, error)
            return None

    def acquire(self) -> bool:
        """Hold the region's lease, waiting at most one lapse of a lease found in storage; LeaseHeld if its
        holder renews it meanwhile. Returns whether another driver held it (its last checkpoints may be newer
        than what was read before)."""
        found = self.current()
        if found is not None:
            self._wait_for_lapse(found)
        self._write()
        if (now := self.current()) is None or now.holder != self.lease.holder:
            raise LeaseHeld(f"region {self.region}: another driver ({now.who if now else 'unknown'}) took it at the "
                            "same moment; stop it, or start this one again once it has ended")
        self._thread = threading.Thread(target=self._renew, name=f"lease-{self.region}", daemon=True)
        self._thread.start()
        return found is not None

    def _wait_for_lapse(self, found: Lease) -> None:
        lapse = LAPSE_PERIODS * found.period
        print(f"[driver] region {self.region}: a lease of {found.who} is in {self.directory}; waiting up to "
              f"{lapse:.0f} s to see whether it is still renewed", flush=True)
        deadline = time.monotonic() + lapse
        while time.monotonic() < deadline:
            time.sleep(min(found.period / 2, max(0.0, deadline - time.monotonic())))
            now = self.current()
            if now is None:  # released: its driver ended
                return
            if now != found:
                raise LeaseHeld(f"region {self.region} is run by another driver ({now.who}, lease {self.directory}/"
                                f"{self.region}.json); stop that job (`ray job stop`) or wait for it to end")
        logger.warning("region %s: taking over the lease of %s (not renewed for %.0f s)", self.region, found.who,
                       lapse)

    def _write(self) -> None:
        _write(self.directory, f"{self.region}.json", json.dumps(asdict(self.lease)).encode())

    def _renew(self) -> None:
        failing = False
        while not self._stop.wait(self.period):
            try:
                now = self.current()
                if now is not None and now.holder != self.lease.holder:
                    logger.error("region %s: the lease was taken over by %s; this driver stops", self.region, now.who)
                    if self.on_lost is not None:
                        self.on_lost(self.region)
                    return
                self.lease = Lease(self.lease.holder, self.lease.who, self.lease.beat + 1, self.period)
                self._write()
                failing = False
            except OSError as error:  # storage unreachable for a while: say it once, keep trying
                if not failing:
                    logger.warning("region %s: cannot renew the lease (%r); retrying", self.region, error)
                failing = True

    def release(self) -> None:
        """Stop renewing; delete the lease if it is still ours (a resubmit then starts at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.period + 5)
        try:
            now = self.current()
            if now is not None and now.holder == self.lease.holder:
                fs, path = resolve_filesystem(join(self.directory, f"{self.region}.json"))
                fs.delete_file(path)
        except OSError as error:
            logger.warning("region %s: could not release the lease (%r); the next driver waits for it to lapse",
                           self.region, error)


def leases_dir(run: RunConfig) -> str:
    return f"{run.storage()}/leases"



@contextlib.contextmanager
def held_regions(run: RunConfig, regions: list[str], on_lost: Callable[[str], None]) -> Iterator[bool]:
    """Claim the run's storage and hold a lease on each of `regions` for the block; released whatever happens.
    Yields whether another driver held one of them until now."""
    claim_storage(run)
    leases: list[RegionLease] = []
    waited = False
    try:
        for region in regions:
            lease = RegionLease(leases_dir(run), region, on_lost)
            waited = lease.acquire() or waited
            leases.append(lease)
        yield waited
    finally:
        for lease in leases:
            lease.release()
