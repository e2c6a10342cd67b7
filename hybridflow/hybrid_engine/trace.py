"""Per-rank timeline events of resharding, written as Chrome-trace JSON (Perfetto / chrome://tracing)."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager


class TraceRecorder:
    """Collects complete ("X") events: name, category, start (us), duration (us), on one rank."""

    def __init__(self, rank: int):
        self.rank = rank
        self.enabled = False
        self.events: list[dict] = []

    @contextmanager
    def span(self, name: str, cat: str, **args):
        if not self.enabled:
            yield
            return
        start = time.time()
        try:
            yield
        finally:
            end = time.time()
            self.events.append({"name": name, "cat": cat, "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6, "pid": self.rank, "tid": cat, "args": args})

    def drain(self) -> list[dict]:
        out, self.events = self.events, []
        return out


def write_chrome_trace(path: str, events: list[dict]) -> str:
    """One process row per rank, one thread row per category (gather / copy / ...)."""
    meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in sorted({e["pid"] for e in events})]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": meta + sorted(events, key=lambda e: e["ts"]), "displayTimeUnit": "ms"}, f)
    return path
