"""A named Ray actor handed to other processes by its name, looked up where it is used.

An actor handle among an actor's constructor arguments (also one inside a Ray Dataset whose map function holds
it) makes Ray log an ERROR line when that actor starts with `max_restarts` > 0: "has constructor arguments in the
object store and max_restarts > 0" (ray-project/ray#53727). Ray cannot tell whether the handle's actor outlives
a restart. The run's `DataCounters` is created by the driver and outlives every reader of it, so the readers
(`RegionStream`, the data pipeline's map tasks) get its name instead, and nothing false is logged at every run.
"""

from __future__ import annotations

from typing import Any

import ray


class ActorByName:
    """Stands in for the handle of the actor `name` in `namespace` (default: the caller's): attribute access
    (`counters.add.remote(...)`) looks the handle up on first use and forwards to it. Pickles as the name: each
    unpickled copy (one per Ray Data map task) looks it up again, one GCS call."""

    def __init__(self, name: str, namespace: str | None = None):
        self.name = name
        self.namespace = namespace if namespace is not None else ray.get_runtime_context().namespace
        self._handle: Any = None

    def __getstate__(self) -> dict:
        return {"name": self.name, "namespace": self.namespace, "_handle": None}

    def __getattr__(self, attribute: str) -> Any:  # only for what the instance lacks: the actor's methods
        if attribute.startswith("_"):  # pickle's and copy's probes (__setstate__, ...) are not the actor's
            raise AttributeError(attribute)
        if self._handle is None:
            self._handle = ray.get_actor(self.name, namespace=self.namespace)
        return getattr(self._handle, attribute)

    def __repr__(self) -> str:
        return f"ActorByName({self.name!r}, namespace={self.namespace!r})"
