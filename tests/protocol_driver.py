"""The drivers of the protocol simulator (`tests/protocol_sim.py`): a stop request (`ray job stop`), the agreement
on it between the regions of one driver, the checkpoints a region commits, and the driver's resubmit.

A driver (`RegionPlan.driver`; a region without one is a driver of its own) runs its regions in one Ray cluster.
Asked to stop, each region hands the request in with its Δ and decides on its group's gathers
(`policy.stops_after_round`). The driver exits once all its regions ended (stopped, finished, left or failed);
submitted again `resubmit_after` later, it resumes every region that stopped from the checkpoint
`policy.choose_resume_steps` picks over all its regions' committed steps, as `run_setup.resume_plan` does: a region
behind takes its peers' state when it starts (`policy.join_target`). A region keeps its newest
`CheckpointStore.keep_default` checkpoints, as the store prunes them.

A mixin of `Simulator`: the world's state (time, the DHT, `checkpoints`) lives in protocol_world.py.
"""

from __future__ import annotations

from protocol_model import POLL, RegionPlan, _Region

from ray_diloco.checkpoint import CheckpointStore
from ray_diloco.sync import policy


class DriverStops:
    """Stop requests, checkpoints and resubmits (see the module docstring)."""

    def _stop_decision(self, region: _Region, agreement: tuple | None) -> bool:
        """As Rounds._run_round and SyncActorImpl.exchange: `policy.stops_after_round` on what the members handed
        in with their Δ (the round's gather); a round that did not average (abandoned, sat out) ends on the request
        as it ends. The workers of an overlapped round were handed back before it ended: a region alone in its
        driver stops with its next round (which then blocks); one of several ends them at the agreed step."""
        asked, own = self._stopping(region.plan), self._driver_regions(region.plan)
        on_request = asked and region.overlapped is None  # also the old rule, for a round that averaged
        if agreement is None:
            return on_request
        handed_in, gathers, log = agreement
        stopping = on_request
        if self.rules.agreed_stop:
            stopping = (policy.stops_after_round(handed_in, gathers, own, asked_since=asked)
                        and (region.overlapped is None or len(own) > 1))
        log["decided"][region.plan.name] = stopping  # what `violations` compares within a driver
        return stopping

    def _driver_regions(self, plan: RegionPlan) -> frozenset[str]:
        """The regions of the driver that runs `plan`'s region (itself alone unless the schedule says otherwise)."""
        if plan.driver is None:
            return frozenset({plan.name})
        return frozenset(p.name for p in self.s.regions if p.driver == plan.driver)

    def _end_window_in_flight(self, region: _Region):
        """The workers handed back by an overlapped round that agreed to stop train their window to its end, then
        stop at the agreed step without averaging it (their data position stays the round's: it is read again).
        A group restart meanwhile is not modelled (its first hand-in ends it the same way, later)."""
        (_, started), region.overlapped = region.overlapped, None
        yield max(0.0, started + self._window_seconds(region.plan, region.progress) - self.now)

    def _stopping(self, plan: RegionPlan) -> bool:
        return plan.stop_at is not None and plan.stop_at <= self.now and plan.name not in self.stops_served

    def _commit(self, region: _Region) -> None:
        """The region's checkpoint of its outer step (θ_global, momentum, data position), the oldest pruned."""
        saved = self.checkpoints.setdefault(region.plan.name, {})
        saved[region.outer.step_count] = (dict(region.outer.global_state()), dict(region.outer.momentum_state()),
                                          region.progress)
        for old in sorted(saved)[:-CheckpointStore.keep_default]:
            del saved[old]

    def _stop(self, region: _Region) -> None:
        """The region ends after the checkpoint (the worker's `checkpoints_at(..., stopping=True)`), withdrawing its
        record (a clean shutdown); its driver, submitted again `resubmit_after` after its regions all ended,
        continues."""
        plan, name = region.plan, region.plan.name
        if region.outer.step_count not in self.checkpoints.get(name, {}):
            self.out.violations.append(f"stop: {name} stopped at step {region.outer.step_count} without a checkpoint "
                                       "of it (resubmitted, it would train windows again)")
        self.stops_served.add(name)
        self.out.stops.append((name, region.outer.step_count))
        self.alive[name] = 0
        self._leave(name)
        for requests in self.pending.values():
            requests[:] = [r for r in requests if r.region != name]
        if plan.resubmit_after is None:
            self.out.gone.add(name)
        elif (plan.driver or name) not in self.resubmitting:
            self.resubmitting.add(plan.driver or name)
            self._resubmit_when_ended(plan)

    def _resubmit_when_ended(self, plan: RegionPlan) -> None:
        """`plan`'s driver exits once its regions all ended; it is submitted again `resubmit_after` later."""
        own = self._driver_regions(plan)
        ended = all(name in self.out.finished or name in self.out.gone or name in self.out.dead
                    or (name in self.stops_served and not self.alive.get(name)) for name in own)
        if not ended:
            self._at(self.now + POLL, lambda: self._resubmit_when_ended(plan))
            return
        self._at(self.now + plan.resubmit_after, lambda: self._resubmit(plan))

    def _resubmit(self, plan: RegionPlan) -> None:
        """The driver again: its regions that stopped resume from the steps `policy.choose_resume_steps` picks."""
        self.resubmitting.discard(plan.driver or plan.name)
        own = sorted(self._driver_regions(plan))
        steps = policy.choose_resume_steps({name: sorted(self.checkpoints.get(name, {})) for name in own},
                                           self.s.checkpoint_every)
        for other in self.s.regions:
            name = other.name
            if name in own and name in self.stops_served and not self.alive.get(name) and name not in self.out.gone:
                self.out.resubmits.append((name, steps[name], max(self.checkpoints.get(name, {}), default=None)))
                self._start(other, resume=steps[name] is not None, step=steps[name])

