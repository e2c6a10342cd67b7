"""The SPMD side: a `Worker` is one Ray actor process of a worker group.

Each worker knows its rank and the group's world size (set as environment variables by the
worker group before the class is constructed) and joins one torch.distributed process group,
shared by every role colocated in the process.

Under Ray a worker runs one call at a time, in the order they were submitted, and records when
each call starts and finishes executing (`tracked_worker_cls`). A second concurrency group
(`PROBE_GROUP`) answers `_group_calls` while a call runs: a caller's deadline counts from the
moment its call starts executing, not from its submission (`worker_group.Pending.result`).
"""

from __future__ import annotations

import collections
import functools
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridflow.controller.decorator import CONCURRENCY_GROUP_ATTR, DISPATCH_ATTR, LAYOUT_ATTR, ROLE_ATTR
from hybridflow.parallel.process_group import pick_device  # noqa: F401  (re-exported)

# Rank 0's rendezvous socket; one per process, shared by every role colocated in it.
_STORE_SOCKET: socket.socket | None = None

# The Ray concurrency group of the probes (`_group_calls`): its own threads, never behind a call
# of the default group (where every other method runs, one at a time).
PROBE_GROUP = "hybridflow_probe"
PROBE_CONCURRENCY = 4  # callers that may probe one worker at once (a probe takes microseconds)


class CallLog:
    """The calls this process has executed or is executing: Ray task id -> [start, end or None]
    (time.monotonic() of this process). One per process (a Ray actor is a process of its own)."""

    KEEP_FINISHED = 1024  # finished calls remembered (a probe may ask about one just finished)

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: collections.OrderedDict[str, list] = collections.OrderedDict()

    def start(self) -> str | None:
        """Record the current Ray task as started; None when it is already running (a tracked
        method called from another one) or there is no task id (not under Ray)."""
        import ray

        try:
            task = ray.get_runtime_context().get_task_id()
        except Exception:  # noqa: BLE001  (not in a Ray task: nothing to record)
            return None
        if task is None:
            return None
        with self.lock:
            if task in self.calls and self.calls[task][1] is None:
                return None
            self.calls[task] = [time.monotonic(), None]
            finished = [t for t, (_, end) in self.calls.items() if end is not None]
            for t in finished[:max(0, len(finished) - self.KEEP_FINISHED)]:
                del self.calls[t]
        return task

    def finish(self, task: str) -> None:
        with self.lock:
            if task in self.calls:
                self.calls[task][1] = time.monotonic()

    def states(self, tasks: list[str]) -> dict:
        """{"calls": task -> (seconds since it started, finished?) for the tasks that started
        (a task not listed has not started), "running": seconds since each unfinished call started}."""
        now = time.monotonic()
        with self.lock:
            calls = {t: (now - self.calls[t][0], self.calls[t][1] is not None) for t in tasks if t in self.calls}
            running = [now - start for start, end in self.calls.values() if end is None]
        return {"calls": calls, "running": running}


CALLS = CallLog()


class Worker:
    """Base class: rank bookkeeping and process-group set-up."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    # ---- called by the worker group, not by users ----
    def _group_master_endpoint(self, host: str) -> tuple[str, int]:
        """Rank 0 opens the rendezvous socket on `host` (its node IP) and keeps it for the store.

        Binding it ourselves (instead of env://, whose TCPStore listens on every interface)
        keeps a local run on loopback only.
        """
        global _STORE_SOCKET
        _STORE_SOCKET = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _STORE_SOCKET.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _STORE_SOCKET.bind((host, 0))
        _STORE_SOCKET.listen(128)
        return host, _STORE_SOCKET.getsockname()[1]

    def _group_node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def _group_set_env(self, env: dict[str, str]) -> None:
        os.environ.update(env)

    def _group_pid(self) -> int:
        return os.getpid()

    def _group_calls(self, tasks: list[str]) -> dict:
        """Which of these calls (Ray task ids) started executing here, and since when; run in
        PROBE_GROUP, so it answers while a call runs (`CallLog.states`)."""
        return CALLS.states(tasks)

    def _group_layout(self, method: str) -> tuple[int, int, bool]:
        """This rank's data-parallel layout for `method` (see `register(..., layout=...)`)."""
        fn = getattr(type(self), method)
        role = getattr(fn, ROLE_ATTR, None)
        owner = self._roles[role] if role else self
        return owner.dispatch_layout(getattr(fn, LAYOUT_ATTR, None))

    def dispatch_layout(self, layout: str | None) -> tuple[int, int, bool]:
        """(dp index, dp size, collect?) for a named layout; by default every rank is its own replica."""
        return self.rank, self.world_size, True

    def init_process_group(self, device: str, timeout_s: float = 600.0) -> None:
        """Join the group's process group once (colocated roles share it). A collective (or the
        rendezvous) that waits longer than `timeout_s` (trainer.collective_timeout_s) raises."""
        if dist.is_initialized():
            return
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            # Ray gives each GPU worker its own CUDA_VISIBLE_DEVICES: then its GPU is device 0.
            torch.cuda.set_device(0 if torch.cuda.device_count() == 1 else self.local_rank)
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if host.startswith("127."):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on loopback too
        # A collective that never completes fails loudly instead of hanging the run.
        timeout = timedelta(seconds=timeout_s)
        if self.rank == 0:
            store = dist.TCPStore(host, port, self.world_size, True, timeout, master_listen_fd=_STORE_SOCKET.fileno())
        else:
            store = dist.TCPStore(host, port, self.world_size, False, timeout)
        dist.init_process_group(backend=backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)


def registered_methods(cls: type) -> dict[str, object]:
    """name -> Dispatch for every public method marked with @register."""
    out = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        mode = getattr(getattr(cls, name, None), DISPATCH_ATTR, None)
        if mode is not None:
            out[name] = mode
    return out


def run_tracked(fn, worker, args: tuple, kwargs: dict):
    """`fn(worker, *args, **kwargs)`, recorded in CALLS (a module function: the class that calls it
    is pickled by value, and this, with CALLS, by reference)."""
    task = CALLS.start()
    try:
        return fn(worker, *args, **kwargs)
    finally:
        if task is not None:
            CALLS.finish(task)


def tracked_worker_cls(cls: type) -> type:
    """`cls` with each registered method recording in `CALLS` when it starts and finishes executing
    (the class a worker group starts as a Ray actor; same name, methods and dispatch attributes)."""

    def tracked(fn):
        @functools.wraps(fn)  # keeps the dispatch/layout/role/group attributes and the signature Ray checks
        def call(self, *args, **kwargs):
            return run_tracked(fn, self, args, kwargs)

        group = getattr(fn, CONCURRENCY_GROUP_ATTR, None)
        if group is not None:  # Ray's own mark: the method's calls run in that concurrency group
            call.__ray_concurrency_group__ = group
        return call

    namespace = {name: tracked(getattr(cls, name)) for name in registered_methods(cls)}
    out = type(cls.__name__, (cls,), namespace)
    out.__qualname__ = f"{cls.__qualname__}.tracked"  # never found by name: pickled by value, with `cls` as its base
    return out


def colocated_worker_cls(roles: dict[str, type]) -> type:
    """One process class holding several roles (e.g. actor_rollout_ref + critic).

    Role `r`'s registered method `m` becomes `r__m` on the fused class, keeping its dispatch
    mode; `ColocatedWorkerGroup.role(r)` exposes it again as plain `m`. The roles share the
    process, its memory and its process group — no extra processes on a small machine.
    """

    def __init__(self, role_kwargs: dict[str, dict]) -> None:
        Worker.__init__(self)
        self._roles = {name: cls(**role_kwargs.get(name, {})) for name, cls in roles.items()}

    namespace: dict[str, object] = {"__init__": __init__}
    for role, cls in roles.items():
        for method, mode in registered_methods(cls).items():

            def call(self, *args, _role=role, _method=method, **kwargs):
                return getattr(self._roles[_role], _method)(*args, **kwargs)

            setattr(call, DISPATCH_ATTR, mode)
            setattr(call, LAYOUT_ATTR, getattr(getattr(cls, method), LAYOUT_ATTR, None))
            setattr(call, ROLE_ATTR, role)
            setattr(call, CONCURRENCY_GROUP_ATTR, getattr(getattr(cls, method), CONCURRENCY_GROUP_ATTR, None))
            namespace[f"{role}__{method}"] = call
    # the roles' concurrency groups (a group's size: the largest any role asks for)
    groups: dict[str, int] = {}
    for cls in roles.values():
        for name, size in getattr(cls, "CONCURRENCY_GROUPS", {}).items():
            groups[name] = max(size, groups.get(name, 0))
    namespace["CONCURRENCY_GROUPS"] = groups
    return type("Colocated_" + "_".join(roles), (Worker,), namespace)
