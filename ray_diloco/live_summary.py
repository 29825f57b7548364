"""One compact line per outer step on the driver's console: what the job page of the Ray dashboard shows
as the job's log, next to the workers' per-step lines.

A thread polls every region's SyncActor (`last_round`, a quick call) and, without blocking, the evaluator;
it prints an outer step once every region has reached it (or after `patience` seconds: a region that left).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray


def summary_line(step: int, total: int, rounds: dict[str, dict], held_out: dict | None) -> str:
    """`[driver] outer 2/3 | held-out 7.21 @2 | r0: loss 7.43, 650 tok/s, 2 regions, 1.30s (shards 0.10 /
    all-reduce 1.00 / apply 0.20), 1.2 MB out | r1: …` from each region's last round record."""
    parts = [f"[driver] outer {step}/{total}"]
    if held_out:
        parts.append(f"held-out {held_out['eval_loss']:.4f} @{held_out['outer_step']}")
    for region, r in rounds.items():
        if not r:
            parts.append(f"{region}: no round yet")
            continue
        text = f"{region}@{r['outer_step'] + 1}:"
        if "loss" in r:
            text += f" loss {r['loss']:.4f}, {r.get('tokens_per_second', 0):,.0f} tok/s,"
        text += f" {r.get('group_size', 0)} region(s), {r.get('seconds', 0):.2f}s"
        if "wait_for_peers_seconds" in r:
            text += (f" (shards {r['wait_seconds']:.2f} / peers {r['wait_for_peers_seconds']:.2f}"
                     f" / all-reduce {r['transfer_seconds']:.2f} / apply {r['apply_seconds']:.2f})")
        text += f", {r.get('bytes_sent', 0) / 1e6:.1f} MB out"
        parts.append(text)
    return " | ".join(parts)


class LiveSummary:
    """Started once the SyncActors run; `stop()` before they are killed."""

    def __init__(self, regions: list[str], actors: list[Any], evaluator: Any, outer_steps: int,
                 patience: float, interval: float = 2.0):
        self.regions, self.actors, self.evaluator = regions, actors, evaluator
        self.outer_steps, self.patience, self.interval = outer_steps, patience, interval
        self.printed = 0
        self.first_seen: dict[int, float] = {}
        self.held_out: dict | None = None
        self._curve_ref = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray-diloco-live-summary", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling; print the last outer step if the thread has not yet."""
        self._stop.set()
        self._thread.join(timeout=15)
        try:
            self._poll(final=True)
        except Exception:  # noqa: BLE001
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._poll()
            except Exception:  # noqa: BLE001 — an actor restarting or gone: the next poll tries again
                pass

    def _poll(self, final: bool = False) -> None:
        rounds = dict(zip(self.regions, ray.get([a.last_round.remote() for a in self.actors], timeout=10)))
        self._poll_evaluator()
        steps = [r["outer_step"] + 1 if r else 0 for r in rounds.values()]
        newest = max(steps)
        if newest <= self.printed:
            return
        seen = self.first_seen.setdefault(newest, time.monotonic())
        if not final and min(steps) < newest and time.monotonic() - seen < self.patience:
            return
        self.printed = newest
        print(summary_line(newest, self.outer_steps, rounds, self.held_out), flush=True)

    def _poll_evaluator(self) -> None:
        if self.evaluator is None:
            return
        if self._curve_ref is None:
            self._curve_ref = self.evaluator.get_curve.remote()
        ready, _ = ray.wait([self._curve_ref], timeout=0)
        if ready:
            curve = ray.get(self._curve_ref)
            self._curve_ref = None
            if curve:
                self.held_out = curve[-1]
