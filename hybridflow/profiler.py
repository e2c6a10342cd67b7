"""Timeline tracing of the hybrid engine's resharding (Chrome-trace JSON for Perfetto / chrome://tracing).

    from hybridflow.profiler import trace_resharding
    with trace_resharding("runs/reshard_trace.json"):
        trainer.fit()

While the block runs, every reshard records per-layer "gather" and "copy" events on every rank;
on exit they are written to the file (one process row per rank).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from hybridflow.hybrid_engine.trace import write_chrome_trace


@dataclass
class TraceSession:
    path: str
    events: list[dict] = field(default_factory=list)


_ACTIVE: list[TraceSession] = []


def active_session() -> TraceSession | None:
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def trace_resharding(path: str = "reshard_trace.json"):
    session = TraceSession(path)
    _ACTIVE.append(session)
    try:
        yield session
    finally:
        _ACTIVE.remove(session)
        write_chrome_trace(path, session.events)
