"""A blocking call awaited from the agents' event loop, in a thread of its own."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


async def in_own_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a thread of its own, not the event loop's default executor.

    Why: that executor has min(32, cores + 4) threads (6 on 2 cores). A call that holds one of them
    while it waits for another user of the same pool deadlocks once that many are in flight: a
    sandboxed agent's run waits for replies that the batcher's generate call (also a thread) must
    produce. Calls that wait on others (sandboxed programs, tools, the backend) each get a thread."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.cancelled():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            out, err = fn(*args, **kwargs), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            out, err = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody awaits the result
            loop.call_soon_threadsafe(settle, out, err)

    threading.Thread(target=run, daemon=True, name=f"hybridflow-{getattr(fn, '__name__', 'call')}").start()
    return await fut
