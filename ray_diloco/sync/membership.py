"""How a region's SyncActor keeps in step with the other regions: it publishes its state record (outer step,
digest of θ_global, phase) and serves its state, reads the others' records, and carries out what
`ray_diloco.sync.policy` decides from them — join the run, wait for the others before a round, adopt a newer state,
settle at the end. Also how it finds the other regions: its peer file in the run's storage, and theirs.

`Membership` is the part of `SyncActorImpl` (actor.py) that does this; it uses the actor's `config`, `region`,
`outer`, `shapes`, `_digest`, `sharer`, `averager`, `_published`, `_connected`, `_peers_read`, `_stored`,
`_stored_read`, `_storage`, `_dht_failing`, `_phase_failing`, `_generation`, `_state_lock` and `record_event`,
all set in `SyncActorImpl.__init__`.

Besides the DHT, each region keeps its record and state in the run's storage (`durable.py`): the last committed
one, and the final one. A region whose driver is gone is known from those: its final state is taken from there.
Every call to that storage has a time bound (`bounded.py`): a hung bucket costs the call, never the wait it is in.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from ray_diloco import metrics
from ray_diloco.sync import auth, durable, peers, policy
from ray_diloco.sync.bounded import LISTING_SECONDS
from ray_diloco.sync.outer import OuterOptimizer, state_digest
from ray_diloco.sync.policy import FINISHED, TRAINING, UNSETTLED, StateRecord

logger = logging.getLogger(__name__)

T = TypeVar("T")
POLL_SECONDS = 0.5  # how often a waiting region reads the other regions' records again


@dataclasses.dataclass(frozen=True)
class Again:
    """What a polling attempt returns when it has no answer yet: try again after `seconds`."""
    seconds: float


def poll(attempt: Callable[[], T | Again]) -> T:
    """The one poll-until-decided loop of the membership's waits (rendezvous, settling at the end, re-syncing
    from a newer state): call `attempt` until it returns an answer, sleeping as each `Again` says. Every attempt
    bounds itself (its own deadline, from the policy or the configured waits), so no wait is unbounded."""
    while True:
        outcome = attempt()
        if not isinstance(outcome, Again):
            return outcome
        if outcome.seconds > 0:
            time.sleep(outcome.seconds)
REPUBLISH_SECONDS = 1.0  # how often a waiting region publishes how long it has waited
PEER_FILES_SECONDS = 5.0  # how often it reads the other regions' peer files (storage listings cost more)


class RoundAbandoned(Exception):
    """The round this thread works for was abandoned (`SyncActorImpl._abandon_in_flight`): it changes nothing."""


class Membership:
    """Publishing, reading and acting on the regions' records (see the module docstring)."""

    def _announce(self) -> None:
        """Log our multiaddrs and write them to the run's storage, where the other regions look for them."""
        maddrs = self.multiaddrs()
        try:
            where = self._storage.call("peer file", lambda: peers.write_peer_file(
                self.config.run.peers_dir(), self.region, maddrs), LISTING_SECONDS)
        except Exception as error:  # storage not writable: regions can still be joined with --initial-peers
            where = f"not written ({error!r:.200})"
        self.record_event("hivemind_started", multiaddrs=maddrs, peer_file=where)

    def _announce_joining(self) -> None:
        """A signed record naming our peer before our first state record (auth.announce_joining)."""
        try:
            stored = auth.announce_joining(self.averager.dht, self.sharer.key, self.region,
                                           ttl=self.sharer.ttl, timeout=self.sharer.dht_timeout)
        except Exception as error:  # noqa: BLE001 — the join is retried (catch_up) once our state record is out
            stored = False
            logger.warning("[%s] naming our peer before the join failed: %r", self.region, error)
        if not stored:
            logger.warning("[%s] our joining record was not stored: a first state download may be refused",
                           self.region)

    def _dial_peer_files(self) -> None:
        """Connect to the regions whose peer files appeared since we last looked (at most every few seconds)."""
        if time.monotonic() - self._peers_read < PEER_FILES_SECONDS:
            return
        self._peers_read = time.monotonic()
        try:
            found = self._storage.call("peer files", lambda: peers.read_peer_files(
                self.config.run.peers_dir(), exclude=self.region), LISTING_SECONDS)
        except Exception as error:
            logger.warning("[%s] reading the peer files failed: %r", self.region, error)
            return
        for region, maddrs in sorted(found.items()):
            if region not in self._connected and peers.connect(self.averager.dht, maddrs):
                self._connected.add(region)
                self.record_event("peer_connected", peer=region, multiaddrs=maddrs)

    def _snapshot(self) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        clone = lambda tensors: {name: t.clone() for name, t in tensors.items()}  # noqa: E731
        return self.outer.step_count, clone(self.outer.global_state()), clone(self.outer.momentum_state())

    def _publish(self, group_size: int, phase: str = TRAINING) -> None:
        """Store our record (and serve the state behind it). Until the store succeeds the record counts as
        published: the sharer keeps it and its refresher thread stores it again every ttl/3."""
        record = StateRecord(self.region, self.outer.step_count, self._digest, group_size, phase,
                             momentum_digest=self._momentum_digest)
        self._published = record
        self.sharer.publish(record, state=self._snapshot(), verify=False)

    def _publish_safely(self, group_size: int, phase: str = TRAINING) -> None:
        """Publish after an outer step or an adoption. θ has changed already, so a DHT timeout here must not fail
        the round (progress, tokens and history would lag θ)."""
        try:
            self._publish(group_size, phase)
        except Exception as error:
            self.record_event("dht_error", during="publishing the state record", error=repr(error)[:300])

    def _set_phase_safely(self, phase: str, waited: float = 0.0) -> None:
        """Publish our phase; a failure is one event per outage (a waiting region publishes every second)."""
        try:
            self.sharer.set_phase(phase, waited)
            self._published = dataclasses.replace(self._published, phase=phase, waited=waited)
            self._phase_failing = False
        except Exception as error:
            if not self._phase_failing:
                self.record_event("dht_error", during=f"publishing phase {phase}", error=repr(error)[:300])
            self._phase_failing = True

    def _read_records(self, leave_out: frozenset[str] = frozenset()) -> list[StateRecord] | None:
        """The live records of the run and the stored final ones of regions without a live record (but those of
        `leave_out`); None if the DHT did not answer in time and storage has none (the policy then waits). One
        event per outage, not one per poll."""
        self._dial_peer_files()  # a region that started at the same moment as we did may have appeared
        stored = [r for r in self._stored_records(finals_only=True) if r.region not in leave_out]
        try:
            records = self.sharer.records()
        except Exception as error:
            if not self._dht_failing:
                self.record_event("dht_error", during="reading state records", error=repr(error)[:300])
            self._dht_failing = True
            return policy.with_stored(None, stored)
        if self._dht_failing:
            self._dht_failing = False
            self.record_event("dht_recovered")
        return policy.with_stored(records, stored)

    def _stored_records(self, finals_only: bool) -> list[StateRecord]:
        """The other regions' records kept in the run's storage, read at most every few seconds (listing a bucket
        costs more than reading the DHT). finals_only: those of regions that finished this run."""
        if time.monotonic() - self._stored_read >= PEER_FILES_SECONDS:
            self._stored_read = time.monotonic()
            try:
                self._stored = self._storage.call("state records", lambda: durable.read_records(
                    self.config.run.states_dir()), LISTING_SECONDS)
            except Exception as error:  # storage unreachable: decide from the DHT alone meanwhile
                logger.warning("[%s] reading the stored state records failed: %r", self.region, error)
        target = self.config.run.outer_steps
        return [stored.record for region, stored in sorted(self._stored.items())
                if region != self.region and (not finals_only or durable.finished(stored, target))]

    def _keep_in_storage(self, record: StateRecord, location: str) -> None:
        """Our record in the run's storage, pointing at the committed state behind it."""
        try:
            self._storage.call("state record", lambda: durable.write_record(
                self.config.run.states_dir(), durable.StoredRecord(record, location)), LISTING_SECONDS)
        except Exception as error:
            self.record_event("storage_error", during=f"storing the record of step {record.outer_step}",
                              error=repr(error)[:300])

    def _keep_final_state(self) -> None:
        """Our final state and its record in the run's storage: a region that arrives after our driver is gone
        takes it from there. If it cannot be stored, the run cannot vouch for its end: unsettled."""
        step, theta, momentum = self._snapshot()
        record = StateRecord(self.region, step, self._digest, self._published.group_size, FINISHED,
                             momentum_digest=self._momentum_digest)
        directory = self.config.run.states_dir()

        def keep() -> None:
            location = durable.save_final_state(directory, self.region, step, theta, momentum, self.config.to_yaml())
            durable.write_record(directory, durable.StoredRecord(record, location))

        try:  # the state's size at the slowest link the run allows, like a download
            self._storage.call("final state", keep, self._download_seconds() + LISTING_SECONDS)
        except Exception as error:
            self.record_event("unsettled_at_end", why="the final state could not be kept in the run's storage "
                                                      "(a region arriving later would not see it)",
                              error=repr(error)[:300])

    def _check_current(self, generation: int | None) -> None:
        if generation is not None and generation != self._generation:
            raise RoundAbandoned(f"[{self.region}] the round was abandoned")

    def _adopt(self, want, kind: str, generation: int | None = None) -> bool:
        """Load θ_global, momentum and outer step from a peer holding `want` (a StateRecord), or from the run's
        storage where `want` is a stored record (its region's driver may be gone)."""
        download = self._download_seconds()  # per holder; a second holder at most (the round's bounds count two)
        state, source = self.sharer.load_from_peers(want, timeout=download, total=2 * download), want.region
        if state is None:
            state, source = self._load_stored(want), "storage"
        if state is None:
            self.record_event(f"{kind}_failed", wanted_step=want.outer_step, wanted_digest=want.digest)
            return False
        old_step = self.outer.step_count
        self._set_state(*state, generation=generation)
        self.record_event(kind, from_step=old_step, to_step=self.outer.step_count, digest=self._digest,
                          source=source)
        return True

    def _load_stored(self, want: StateRecord):
        """`want`'s state from the run's storage: from its region's stored record, else from another region's
        stored record of the same step and digest. None if none can be read and matches its record (each
        rejected one counted in an event)."""
        holders = sorted((stored for stored in self._stored.values()
                          if (stored.record.outer_step, stored.record.digest) == (want.outer_step, want.digest)),
                         key=lambda stored: (stored.record.region != want.region, stored.record.region))
        for stored in holders:
            try:
                return self._storage.call("stored state", lambda stored=stored: durable.load_state(
                    stored, self.shapes), self._download_seconds())
            except Exception as error:  # unreadable, or not the state its record names: never loaded
                self.record_event("stored_state_rejected", location=stored.location, error=repr(error)[:300])
        return None

    def _download_seconds(self) -> float:
        """How long loading θ_global and momentum (fp32) from one holder may take (outer.state_download_mbps)."""
        state_bytes = 2 * 4 * sum(math.prod(shape) for shape in self.shapes.values())
        outer = self.config.outer
        return policy.download_seconds(state_bytes, outer.state_download_mbps, at_least=outer.averaging_timeout)

    def _set_state(self, step: int, theta: dict, momentum: dict, generation: int | None = None) -> None:
        """Replace the outer state at once (it may run in an executor thread while `resume_state` reads); not for
        a round that was abandoned meanwhile (`generation`: the round's, None: not a round's)."""
        cfg = self.config.outer
        outer = OuterOptimizer(theta, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
        outer.load_momentum(momentum)
        outer.step_count = step
        digest, momentum_digest = state_digest(outer.global_state()), state_digest(outer.momentum_state())
        with self._state_lock:
            self._check_current(generation)
            self.outer, self._digest, self._momentum_digest = outer, digest, momentum_digest
            if self.compressor is not None:  # another θ_global: what we owed on the old one is void (compressed.py)
                self.compressor.state = {}
        metrics.safely(metrics.record_outer_step, self.config.run.name, self.region, step)

    def _join_if_behind(self) -> None:
        """A region starting mid-run takes the run's state before its workers take their first step."""
        started_here = frozenset(region.name for region in self.config.local_regions())
        records = policy.startup_records(self._read_records(leave_out=started_here),
                                         self._stored_records(finals_only=False), started_here) or []
        own = StateRecord(self.region, self.outer.step_count, self._digest, 0)
        target = policy.join_target(own, records)
        if target is not None:
            self._adopt(target, "region_joined")

    def _rendezvous(self, arrived: float, generation: int | None = None) -> policy.Run | policy.Finish:
        """Our workers wait on this round from `arrived` (our monotonic clock: now, or with outer.overlap one
        window later, when they hand in the next): run `policy.Rendezvous` until it says run a round (with whom)
        or finish, carrying out what it asks (publish our phase, load a state, sleep). Loads are tried until the
        round's deadline plus one download."""
        outer = self.config.outer
        machine = policy.Rendezvous(target=self.config.run.outer_steps, arrived=arrived,
                                    max_wait=outer.max_wait_seconds,
                                    give_up=arrived + outer.max_wait_seconds + self._download_seconds(),
                                    poll=POLL_SECONDS, republish=REPUBLISH_SECONDS)

        def attempt() -> policy.Run | policy.Finish | Again:
            self._check_current(generation)
            action = machine.next(self._published, self._read_records(), time.monotonic())
            if isinstance(action, policy.Publish):
                self._set_phase_safely(action.phase, waited=action.waited)
                return Again(0.0)
            if isinstance(action, policy.Adopt):
                loaded = self._adopt(action.record, "resync", generation)
                if loaded:
                    self._publish_safely(0)
                machine.loaded(loaded)
                return Again(0.0)
            if isinstance(action, policy.Sleep):
                return Again(action.seconds)
            if isinstance(action, policy.Run) and action.gave_up is not None:
                self.record_event("resync_gave_up", wanted_step=action.gave_up.outer_step,
                                  wanted_digest=action.gave_up.digest)
            return action

        return poll(attempt)

    def _settle_at_end(self, generation: int | None = None) -> None:
        """After our last round: once the live regions reached the last step (or max_wait passed), take the
        canonical state, so every region that finishes holds the same θ_global (a last round that failed
        mid-way or went without some region leaves them different)."""
        cfg = self.config
        if self._published is not None and self._published.phase in (FINISHED, UNSETTLED):
            # Settled once already (a re-sync reached the end during an overlapped round): a finished region's
            # state is final, the others may have taken it since.
            return
        ended = time.monotonic()
        machine = policy.Settling(target=cfg.run.outer_steps, ended=ended, max_wait=cfg.outer.max_wait_seconds,
                                  give_up=ended + cfg.outer.max_wait_seconds + self._download_seconds(),
                                  poll=POLL_SECONDS)

        def attempt() -> bool | Again:
            self._check_current(generation)
            # After a failed load the machine decides without records (it sleeps a poll or ends): none are read.
            records = None if machine.load_failed else self._read_records()
            action = machine.next(self._published, records, time.monotonic())
            if isinstance(action, policy.Adopt):
                loaded = self._adopt(action.record, "settled_at_end", generation)
                if loaded:
                    self._publish_safely(0)
                machine.loaded(loaded)
                return Again(0.0)
            if isinstance(action, policy.Sleep):
                return Again(action.seconds)
            self._set_phase_safely(FINISHED if action.settled else UNSETTLED)
            if action.settled:  # an unsettled end is not a final state for others to take
                self._keep_final_state()
            else:  # the driver's summary then names the regions that disagree, and the command fails
                self.record_event("unsettled_at_end", why="the DHT did not answer, or the canonical state "
                                                          "could not be loaded, in time")
            return True

        poll(attempt)

    def _resync_from_newer(self, own_step: int, generation: int | None = None) -> str | None:
        """Run `policy.Resync` (wait up to max_wait plus one download for another region's record past `own_step`;
        adopt the canonical one). None once adopted, else why not (`Stop.why`). `generation`: the round's (an
        abandoned round's thread changes nothing)."""
        machine = policy.Resync(own_step=own_step, region=self.region, poll=POLL_SECONDS,
                                give_up=time.monotonic() + self.config.outer.max_wait_seconds + self._download_seconds())

        def attempt() -> str | None | Again:
            self._check_current(generation)
            # After a failed load the machine decides without records (it sleeps a poll or stops): none are read.
            action = machine.next(None if machine.load_failed else self._read_records(), time.monotonic())
            if isinstance(action, policy.Adopt):
                loaded = self._adopt(action.record, "resync", generation)
                machine.loaded(loaded)
                return None if loaded else Again(0.0)
            return Again(action.seconds) if isinstance(action, policy.Sleep) else action.why

        return poll(attempt)
