"""Hung Hivemind nodes in the protocol simulator (`tests/protocol_sim.py`): a region's node that stops answering in
a round (`Schedule.hangs`, `Schedule.hangs_after_step`), and what the SyncActor's own decisions do about it.

While the node hangs, the region's record is no longer refreshed (it expires after `Schedule.ttl`) and its state is
not served. A blocking round that hangs before its outer step is given up at `policy.round_bound` and
`policy.overdue_round` abandons it (ABANDON: the workers go on at the same step) or, the limit-th in a row, fails the
group (FAIL); one that hangs after its outer step finishes in the background (FINISH_IN_BACKGROUND) and the next
round waits for it. A round in flight (overlapped, or finishing in the background) is abandoned by the next round
once it has waited `round_bound` for it (`policy.overdue_in_flight`), or by the handshake of a group that restarts.
The simulator counts abandoned rounds in a row itself (`_saw`): a region must not train on for ever without
averaging.

A mixin of `Simulator`: the world's state lives in protocol_world.py, a region's in protocol_model._Region.
"""

from __future__ import annotations

from protocol_model import _Region

from ray_diloco.sync import policy


class Hangs:
    """A region's Hivemind node that stops answering mid-round (see the module docstring)."""

    def _hang(self, region: _Region):
        """As SyncActorImpl._blocking_round when the region's Hivemind node stops answering at the round's first
        DHT call: nothing is published or refreshed (its record expires, its state is not served) until the round
        is given up at `policy.round_bound`. Returns `policy.overdue_round`'s action (the old rule: FAIL). The hang
        is before the outer step (one after it: `_publish_hung`, `_finish_in_background`)."""
        self._node_hangs(region)
        yield self._bound()
        self._node_answers(region)
        if not self.rules.abandon_hung_rounds:  # the old actor: the other ranks raised, a Ray Train failure
            return policy.FAIL
        action, region.abandoned_in_a_row = policy.overdue_round(applied=False,
                                                                 abandoned_in_a_row=region.abandoned_in_a_row)
        self._saw(region, action)
        return action

    def _node_hangs(self, region: _Region) -> None:
        """The region's Hivemind node stops answering (a round's DHT call that never returns): its record is no
        longer refreshed and its state no longer served, until `_node_answers`."""
        name = region.plan.name
        if name in self.dht:
            self.dht[name][1] = min(self.dht[name][1], self.now + self.s.ttl)
        region.hung_node = (self.served.pop(name, None),)

    def _publish_hung(self, region: _Region, group: int) -> None:
        """As Membership._publish when the region's Hivemind node stops answering at the store: the record counts as
        published (the sharer stores it when the node answers again); until then the old one expires and nothing
        is served."""
        name = region.plan.name
        before = self.dht.get(name)  # what the DHT holds: the record before (the store never reaches it)
        self.publish(region, group)
        if before is None:
            self.dht.pop(name, None)
        else:
            self.dht[name] = list(before)
        self._node_hangs(region)

    def _finish_in_background(self, region: _Region, handed_in: float):
        """As SyncActorImpl._blocking_round: the round is still running at its bound, counted from the hand-in, with
        its outer step applied: `policy.overdue_round` lets it finish in the background (the workers go on from
        the new state) and the next round waits for it (`_overdue_in_flight`)."""
        yield max(0.0, handed_in + self._bound() - self.now)
        action, region.abandoned_in_a_row = policy.overdue_round(applied=True,
                                                                 abandoned_in_a_row=region.abandoned_in_a_row)
        assert action == policy.FINISH_IN_BACKGROUND, action
        self.out.finished_in_background.append((region.plan.name, region.outer.step_count))

    def _overdue_in_flight(self, region: _Region):
        """As SyncActorImpl._complete_round: the next round waits `policy.round_bound` for the hung round in flight,
        then abandons it (`policy.overdue_in_flight`: or fails the workers, the limit-th in a row). Returns the
        action (the old rule: ABANDON, never counted)."""
        yield self._bound()
        self._node_answers(region)
        if not self.rules.count_overlapped_hangs:
            action = policy.ABANDON
        else:
            action, region.abandoned_in_a_row = policy.overdue_in_flight(region.abandoned_in_a_row)
        self.out.abandoned_in_flight.append((region.plan.name, region.outer.step_count))
        self._saw(region, action)
        return action

    def _bound(self) -> float:
        return policy.round_bound(self.s.max_wait, self.s.averaging_timeout, self.download_bound())

    def _node_answers(self, region: _Region) -> None:
        """The hung round is given up: the region's node answers again and the sharer's refresh stores its record."""
        (served,), region.hung_node = region.hung_node, None
        if served is not None:
            self.served[region.plan.name] = served
        self._store(region.plan.name, region.incarnation)

    def _saw(self, region: _Region, action: str) -> None:
        """The simulator's own count of rounds abandoned in a row: a region whose Hivemind node stays hung must fail
        its workers by the ABANDONED_ROUNDS_LIMIT-th (Ray Train's restarts, then it leaves the run), not train on
        without ever averaging, each abandoned round leaving a thread blocked."""
        name = region.plan.name
        if action == policy.ABANDON:
            self.out.abandoned.append((name, region.outer.step_count))
            region.seen_abandoned += 1
            if region.seen_abandoned >= policy.ABANDONED_ROUNDS_LIMIT:
                self.out.violations.append(f"bounded: {name} abandoned {region.seen_abandoned} rounds in a row "
                                           "and trained on")
        elif action == policy.FAIL:
            region.seen_abandoned = 0
