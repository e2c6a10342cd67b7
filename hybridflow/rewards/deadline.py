"""A sample's reward deadline, seen by the code it scores (``custom_reward_function.timeout_s``).

The reward manager scores a sample in a thread of its own and stops waiting for it at the deadline
(``scoring.call_with_deadline``). Python cannot stop that thread, but the work that matters can see
the deadline: the code reward (``code.py``) bounds every sandbox run's wall time by what is left of
it, so at the deadline the sandbox's own kill (its cgroup, then its pid namespace: every process,
also one that left the process group with ``setsid``) stops the run, and no further test case
starts. ``active()`` counts such runs, so the manager can wait the few milliseconds a kill takes
before it reports the sample as timed out: when the manager returns, none of its sandboxes is left.

Torch-free (imported in the reward workers, ``workers.py``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator


class DeadlinePassed(Exception):
    """The sample's reward deadline passed: stop scoring it (the manager counts it as a timeout)."""


class SampleDeadline:
    """The monotonic time ``at`` a sample's scoring must end by, and the sandbox runs in flight for it."""

    def __init__(self, at: float):
        self.at = at
        self._lock = threading.Lock()
        self._running = 0
        self._idle = threading.Event()
        self._idle.set()

    def left(self) -> float:
        return self.at - time.monotonic()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around one sandbox run (or other killable work) bounded by this deadline."""
        with self._lock:
            self._running += 1
            self._idle.clear()
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self._idle.set()

    def wait_stopped(self, timeout_s: float) -> bool:
        """Wait until no run of this sample is in flight (True), at most ``timeout_s`` (False)."""
        return self._idle.wait(timeout_s)


_local = threading.local()


@contextlib.contextmanager
def bound(deadline: SampleDeadline | None) -> Iterator[None]:
    """Code run in this block (in this thread) sees ``deadline`` through :func:`current`."""
    before = getattr(_local, "deadline", None)
    _local.deadline = deadline
    try:
        yield
    finally:
        _local.deadline = before


def current() -> SampleDeadline | None:
    """The deadline of the sample this thread is scoring, or None (no ``timeout_s``, or not scoring)."""
    return getattr(_local, "deadline", None)
