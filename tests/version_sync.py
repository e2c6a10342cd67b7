"""The trainer's weight sync for fake replicas whose weights are their version (the async rollout,
replica and rollout-manager tests): `publish_for_rollout(v)` is the trainer's slow half (nothing to
publish here: it records v), `submit()` queues `receive_weights(v)` on every replica, behind the
generations already queued there. Subclasses override either half to slow, lose or kill a sync."""

from __future__ import annotations

import types
from typing import Any


class PendingSync:
    """A submitted sync: `finish()` waits for every replica's receipt and returns the sync's metrics."""

    def __init__(self, call: Any, metrics: dict[str, float] | None = None):
        self.call, self.metrics, self.publish_s = call, metrics or {}, 0.0

    def finish(self, timeout_s: float | None = None) -> dict[str, float]:
        self.call.result(timeout_s)
        return dict(self.metrics)


class VersionSync:
    def __init__(self, replicas: Any, metrics: dict[str, float] | None = None):
        self.replicas, self.metrics, self.version = replicas, metrics, 0

    def publish_for_rollout(self, version: int) -> types.SimpleNamespace:
        self.version = version
        return types.SimpleNamespace(submit=self.start_rollout_sync)

    def start_rollout_sync(self) -> PendingSync:
        return PendingSync(self.replicas.submit("receive_weights", self.version), self.metrics)
