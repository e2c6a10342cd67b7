"""The single controller's handle on a group of SPMD workers running as Ray actors.

    pool = ResourcePool(nnodes=1, procs_per_node=2, cpus_per_worker=0.5)
    wg = RayWorkerGroup(pool, ActorRolloutRefWorker, config=cfg)
    wg.init_model()                  # ONE_TO_ALL: every rank runs it
    out = wg.generate_sequences(b)   # DP_COMPUTE: b split by rank, results concatenated

Every method a worker class marks with `@register(...)` becomes a method of the group. Workers
of one group join one torch.distributed process group; rank 0 proposes the rendezvous address.
Fractional CPU requests let N workers plus the driver share a small machine without deadlock.

Deadlines (`Pending.result(timeout_s=...)`, e.g. actor_rollout_ref.rollout.request_timeout_s) count
from the moment a call starts executing on its worker, not from its submission: a worker runs one
call at a time, and a call queued behind others (agent turns of several batch threads, partial
rollout's segments, a weight sync) is not late while the worker works through them. Each worker
records when its calls start and finish (`worker.CallLog`) and answers probes in a concurrency
group of its own (`worker.PROBE_GROUP`) while a call runs. When a deadline passes, the unfinished
workers are probed (at most PROBE_TIMEOUT_S, or the deadline if shorter): a call not started yet
waits on, one started less than timeout_s ago gets until its start + timeout_s; one running longer,
one queued behind a call running longer than timeout_s, and a worker that does not answer the probe
(a stopped or hung process) fail with WorkerTimeoutError naming the ranks, a dead worker with
WorkerDiedError. A stopped worker is so named within timeout_s + the probe's timeout.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from typing import Any

from hybridflow.config.schema import DEFAULT_WORKER_ENV, PoolSpec
from hybridflow.controller.decorator import LAYOUT_ATTR, Dispatch, collect_results, dispatch_args
from hybridflow.config.pools import bundle, missing_resources
from hybridflow.controller.worker import PROBE_CONCURRENCY, PROBE_GROUP, colocated_worker_cls, registered_methods, tracked_worker_cls

# Read by Ray at import time: without it Ray swaps a 127.0.0.1 node address for the machine's
# routable IP and its servers listen on every interface. With it, a local cluster stays on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")



def concurrency_groups(worker_cls: type) -> dict[str, int]:
    """The Ray concurrency groups a worker class's actor is started with: the probes' and the class's own."""
    return {PROBE_GROUP: PROBE_CONCURRENCY, **getattr(worker_cls, "CONCURRENCY_GROUPS", {})}

class _LazyRay:
    """`ray`, imported at its first use: importing this module (and the trainer above it) needs no
    Ray, so a torchrun-only install (trainer.launcher=torchrun: one node, no Ray) works without it."""

    def __getattr__(self, name: str) -> Any:
        import ray

        return getattr(ray, name)


ray = _LazyRay()

PROBE_TIMEOUT_S = 5.0  # the most a probe of a worker's calls may take (less where the call's deadline is shorter)

# The worker actors that answer probes (every actor a RayWorkerGroup starts): Ray actor id -> handle,
# so that a Pending built from bare object refs (`ReplicaSet` routes requests itself) finds them.
_PROBED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _probed(handle, worker_cls: type) -> None:
    if hasattr(worker_cls, "_group_calls"):  # a `Worker`: it answers probes
        _PROBED[handle._actor_id.hex()] = handle


def _actor_of(ref) -> Any:
    """The probed worker actor that runs the call of `ref`, or None (not started by a worker group)."""
    try:
        return _PROBED.get(ref.task_id().actor_id().hex())
    except Exception:  # noqa: BLE001  (not an actor task's ref)
        return None


def call_progress(calls: list[tuple[Any, Any]], timeout_s: float, probe_timeout_s: float | None = None) -> list[tuple[str, Any]]:
    """How each unfinished call (actor handle or None, object ref) stands against a deadline of
    `timeout_s` seconds of execution, asked of its worker (`Worker._group_calls`, in PROBE_GROUP):
    ("wait", seconds until it is due again: not started yet, or started less than timeout_s ago),
    ("late", why) or ("dead", why). A call without a handle is late (its deadline counts from its
    submission); a worker that does not answer within `probe_timeout_s` (default: the smaller of
    PROBE_TIMEOUT_S and timeout_s) is late: a stopped or hung process."""
    probe_s = min(PROBE_TIMEOUT_S, timeout_s) if probe_timeout_s is None else probe_timeout_s
    out: list[tuple[str, Any]] = [("late", "")] * len(calls)
    asked: dict[str, tuple[Any, list[int]]] = {}  # actor id -> (handle, indices of its calls)
    for i, (handle, _) in enumerate(calls):
        if handle is not None:
            asked.setdefault(handle._actor_id.hex(), (handle, []))[1].append(i)
    if not asked:
        return out
    probes = {actor: handle._group_calls.options(concurrency_group=PROBE_GROUP).remote([calls[i][1].task_id().hex() for i in idx])
              for actor, (handle, idx) in asked.items()}
    answered, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=probe_s)
    for actor, (_, idx) in asked.items():
        probe = probes[actor]
        if probe not in answered:
            out = _set(out, idx, ("late", f"no answer to a probe within {probe_s:g} s: a stopped or hung process"))
            continue
        try:
            states = ray.get(probe)
        except ray.exceptions.ActorUnavailableError:
            out = _set(out, idx, ("late", "unreachable"))
            continue
        except ray.exceptions.RayActorError as e:
            out = _set(out, idx, ("dead", _first_line(e)))
            continue
        except ray.exceptions.RayError:
            continue  # cannot tell: late, as without a probe
        ahead = max(states["running"], default=0.0)  # the call running now, if any
        for i in idx:
            state = states["calls"].get(calls[i][1].task_id().hex())
            if state is None:  # queued behind other calls
                out[i] = ("late", f"queued behind a call running for {ahead:.0f} s") if ahead >= timeout_s else ("wait", timeout_s - ahead)
            elif state[1]:  # finished: its result is on its way
                out[i] = ("wait", probe_s)
            else:
                out[i] = ("late", f"running for {state[0]:.0f} s") if state[0] >= timeout_s else ("wait", timeout_s - state[0])
    return out


def _set(out: list, idx: list[int], verdict: tuple[str, Any]) -> list:
    return [verdict if i in idx else v for i, v in enumerate(out)]


def placement_group(*args, **kwargs):
    from ray.util.placement_group import placement_group as make

    return make(*args, **kwargs)


def remove_placement_group(pg) -> None:
    from ray.util.placement_group import remove_placement_group as remove

    remove(pg)


def PlacementGroupSchedulingStrategy(pg, **kwargs):  # noqa: N802  (Ray's class, built lazily)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as strategy

    return strategy(pg, **kwargs)


def init_ray(address: str | None = None, num_cpus: int | None = None, resources: dict[str, float] | None = None) -> None:
    """Start an embedded local cluster bound to 127.0.0.1 (with custom `resources`, e.g. a label
    {"H100": 2}), or join `address` ("auto", host:port)."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address and address != "local":
        try:
            ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            from hybridflow.config.loader import ConfigError

            raise ConfigError(f"ray_init.address={address!r}: cannot join that Ray cluster ({e}); start it (`ray start --head`) "
                              f"or unset ray_init.address / RAY_ADDRESS to run an embedded local cluster") from None
        return
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case ray was imported before hybridflow
    os.environ.pop("RAY_ADDRESS", None)  # "local" below: never a stale cluster's address file
    ray.init(
        address="local",
        num_cpus=num_cpus or os.cpu_count(),
        resources=resources,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
    )


class ResourcePool:
    """Placement groups reserving `procs_per_node` worker slots on each of `nnodes` nodes.

    `resources` adds per-worker Ray resources (custom labels such as {"H100": 1}, an accelerator
    type). Check the cluster first (`resource_pool.missing_resources`): a placement group that
    cannot be placed waits forever; here it fails after `ready_timeout` seconds naming the pool.
    """

    def __init__(self, nnodes: int = 1, procs_per_node: int = 2, cpus_per_worker: float = 0.5, gpus_per_worker: float = 0.0,
                 resources: dict[str, float] | None = None, name: str = "global_pool", ready_timeout: float = 120):
        self.name = name
        self.nnodes = nnodes
        self.procs_per_node = procs_per_node
        self.world_size = nnodes * procs_per_node
        bundle = {"CPU": cpus_per_worker}
        if gpus_per_worker:
            bundle["GPU"] = gpus_per_worker
        bundle.update(resources or {})
        self.bundle = bundle
        # One placement group per node, packed: ranks of a node are consecutive.
        self.groups = [placement_group([dict(bundle)] * procs_per_node, strategy="STRICT_PACK") for _ in range(nnodes)]
        try:
            ray.get([pg.ready() for pg in self.groups], timeout=ready_timeout)
        except ray.exceptions.GetTimeoutError:
            self.release()
            raise RuntimeError(f"resource pool {name!r}: {nnodes} node(s) x {procs_per_node} workers of {bundle} could not be "
                               f"placed within {ready_timeout:.0f}s (cluster resources: {ray.available_resources()})") from None

    def slots(self) -> list[tuple[Any, int, int]]:
        """(placement group, bundle index, local rank) for every global rank, in rank order."""
        return [(pg, i, i) for pg in self.groups for i in range(self.procs_per_node)]

    def release(self) -> None:
        for pg in self.groups:
            remove_placement_group(pg)


def place_pools(specs: dict[str, PoolSpec], default_cpus: float, device: str) -> dict[str, ResourcePool]:
    """One ResourcePool per spec, after checking all of them against the cluster (`ray.nodes()`):
    a resource it lacks is a ConfigError naming the pool, before any placement group exists. If a
    pool still fails to place, the ones already placed are released."""
    from hybridflow.config.loader import ConfigError

    used = {name: (spec, bundle(spec, default_cpus, device)) for name, spec in specs.items()}
    problems = missing_resources(used, ray.nodes())
    if problems:
        raise ConfigError("the resource pools do not fit the Ray cluster:\n" + "\n".join(f"  - {p}" for p in problems))
    pools: dict[str, ResourcePool] = {}
    try:
        for name, (spec, res) in used.items():
            extra = {k: v for k, v in res.items() if k not in ("CPU", "GPU")}
            pools[name] = ResourcePool(spec.nnodes, spec.workers_per_node, res["CPU"], res.get("GPU", 0.0), extra, name=name)
    except BaseException:
        for pool in pools.values():
            pool.release()
        raise
    return pools


class RayWorkerGroup:
    """N Ray actors of one worker class, called by the driver like one object."""

    def __init__(self, pool: ResourcePool, worker_cls: type, *, name: str = "wg", device: str = "cpu", env: dict[str, str] | None = None,
                 worker_env: dict[str, str] | None = None, straggler_timeout_s: float | None = None, **init_kwargs):
        """worker_env: every worker's environment (trainer.worker_env; None = its default,
        DEFAULT_WORKER_ENV); env: extra variables on top of it. straggler_timeout_s: once one rank of
        a call has finished, how long the others may take (SPMD ranks finish together;
        trainer.collective_timeout_s). None: no limit."""
        base_env = DEFAULT_WORKER_ENV if worker_env is None else worker_env
        self.pool = pool
        self.straggler_timeout_s = straggler_timeout_s
        self.world_size = pool.world_size
        self.worker_cls = worker_cls
        # One call at a time in the default group; probes of the calls in a group of their own; methods the
        # worker class puts in a group of its own (`decorator.concurrent`: a replica's requests) run there.
        remote_cls = ray.remote(concurrency_groups=concurrency_groups(worker_cls))(tracked_worker_cls(worker_cls))
        self.workers = []
        self._start = (remote_cls, init_kwargs, [])  # what `replace_worker` starts again: the class, its kwargs, each rank's options
        self.replaced = 0  # workers replaced so far (each replacement's name is new)
        for rank, (pg, bundle_index, local_rank) in enumerate(pool.slots()):
            worker_env = {**base_env, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(local_rank)}
            options = {
                "num_cpus": pool.bundle["CPU"],
                "num_gpus": pool.bundle.get("GPU", 0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index),
                "runtime_env": {"env_vars": worker_env},
                "name": f"{name}_{rank}",
            }
            self._start[2].append(options)
            self.workers.append(remote_cls.options(**options).remote(**init_kwargs))
            _probed(self.workers[-1], worker_cls)
        # Rendezvous: rank 0 names an address and a free port; everyone gets it before init.
        node_ip = ray.get(self.workers[0]._group_node_ip.remote())
        master_addr, master_port = ray.get(self.workers[0]._group_master_endpoint.remote(node_ip))
        ray.get([w._group_set_env.remote({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}) for w in self.workers])
        self._layouts: dict[str, list] = {}
        for method, mode in registered_methods(worker_cls).items():
            call = functools.partial(self._call, method, mode)
            call.pool_name = getattr(pool, "name", "global_pool")  # the DataFlow scheduler reads it
            setattr(self, method, call)

    def _layout(self, method: str) -> list | None:
        if getattr(getattr(self.worker_cls, method), LAYOUT_ATTR, None) is None:
            return None
        if method not in self._layouts:
            self._layouts[method] = ray.get([w._group_layout.remote(method) for w in self.workers])
        return self._layouts[method]

    def submit(self, method: str, *args, **kwargs) -> "Pending":
        """Start `method` on every worker without waiting; `.result()` collects it."""
        mode = registered_methods(self.worker_cls)[method]
        layout = self._layout(method)
        rank_args, rank_kwargs, pad = dispatch_args(mode, self.world_size, args, kwargs, layout)
        refs = [getattr(w, method).remote(*a, **k) for w, a, k in zip(self.workers, rank_args, rank_kwargs)]
        return Pending(refs, lambda results: collect_results(mode, results, pad, layout), method, getattr(self.pool, "name", "global_pool"),
                       self.straggler_timeout_s)

    def _call(self, method: str, mode: Dispatch, *args, **kwargs) -> Any:
        return self.submit(method, *args, **kwargs).result()

    def pids(self) -> list[int]:
        return ray.get([w._group_pid.remote() for w in self.workers])

    def replace_worker(self, rank: int, start_timeout_s: float | None = None) -> None:
        """Kill rank `rank`'s actor and start a new one in its slot (same placement bundle, class,
        arguments and environment; named `<name>_<rank>_r<n>`, n counting this group's
        replacements). It joins no process group: only workers that need none (a generation
        replica of one process) can be replaced. start_timeout_s: wait until the new process
        answers a probe (it is up: interpreter, imports, constructor), at most that long. Calls'
        deadlines count from their start on the worker, and an actor still being constructed
        answers no probe, so a caller that times the new worker's first call should wait for this first."""
        remote_cls, init_kwargs, options = self._start
        ray.kill(self.workers[rank], no_restart=True)
        self.replaced += 1
        self.workers[rank] = remote_cls.options(**{**options[rank], "name": f"{options[rank]['name']}_r{self.replaced}"}).remote(**init_kwargs)
        _probed(self.workers[rank], self.worker_cls)
        if start_timeout_s is not None and hasattr(self.worker_cls, "_group_calls"):
            pool = getattr(self.pool, "name", "global_pool")
            probe = self.workers[rank]._group_calls.options(concurrency_group=PROBE_GROUP).remote([])
            if not ray.wait([probe], timeout=start_timeout_s)[0]:
                raise WorkerTimeoutError(f"the replacement of rank {rank} (pool {pool!r}) did not start within {start_timeout_s:g} s", (rank,))
            try:
                ray.get(probe)  # a constructor that raised, or a slot on a node that is gone: named here
            except ray.exceptions.RayActorError as e:
                cause = _first_line(e)
                raise WorkerDiedError(f"the replacement of rank {rank} (pool {pool!r}) died before it started: {cause}; {RESUME_HINT}",
                                      (rank,)) from None

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []


class WorkerCallError(RuntimeError):
    """A worker raised during a call (e.g. a collective that timed out: trainer.collective_timeout_s)."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = ranks  # the ranks that died or did not finish (empty: a worker raised)


class WorkerDiedError(WorkerCallError):
    """A worker process of a group died (killed, out of memory, crashed) during a call."""


class WorkerTimeoutError(WorkerCallError):
    """A call did not finish within the deadline its caller gave (`Pending.result(timeout_s=...)`)."""


def _first_line(e: BaseException) -> str:
    """What Ray says of a dead actor, in one line (its message's first, or the error's type)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


RESUME_HINT = ("re-run the same command to resume from the latest checkpoint in trainer.default_local_dir "
               "(trainer.resume_mode=auto; checkpoints every trainer.save_freq steps)")


class Pending:
    """A worker-group call in flight (Ray object refs) and how to collect its results.

    `result()` collects the ranks as they finish, so a rank that dies or raises is reported at
    once, naming role, rank and pool, while the other ranks may still wait in a collective for it.
    Once a rank has finished, the others get `straggler_timeout_s` to finish too; a rank stuck
    outside any collective (which would time out by itself) is then reported instead of waited for.
    A caller's deadline counts from the moment the call starts executing on each worker (see the
    module's docstring)."""

    def __init__(self, refs: list, collect, method: str = "", pool: str = "", straggler_timeout_s: float | None = None,
                 ranks: list[int] | None = None):
        """ranks: the rank each ref runs on (None: ref i on rank i)."""
        self.refs = refs
        self.ranks = list(range(len(refs))) if ranks is None else ranks
        self.collect = collect
        role, _, name = method.rpartition("__")  # colocated groups call "<role>__<method>"
        self.role, self.method, self.pool = role or "worker", name, pool
        self.straggler_timeout_s = straggler_timeout_s
        self.submitted = time.monotonic()

    def result(self, timeout_s: float | None = None, waiting_for: str = "", key: str = "") -> Any:
        """The collected results. timeout_s: the most each rank's call may take once it has
        started executing on its worker (None: no limit but the stragglers' one); past it, or when
        a worker does not answer a probe, a WorkerTimeoutError names `waiting_for` (what the caller
        waits for), the late ranks, the pool, how long since the call was submitted and `key`, the
        config key that sets the limit."""
        done: dict = {}
        waiting = list(self.refs)
        straggler_deadline = None
        due = None if timeout_s is None else time.monotonic() + timeout_s  # when the unfinished calls are asked about next
        deferred = False  # whether a late rank was held back once for the others about to be late (see _next_due)
        while waiting:
            deadlines = [d for d in (straggler_deadline, due) if d is not None]
            timeout = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=timeout)
            if not ready:
                if due is not None and (straggler_deadline is None or due <= straggler_deadline):  # the caller's deadline came first
                    due, deferred = self._next_due(waiting, timeout_s, waiting_for, key, deferred)
                    continue
                ranks = [self.ranks[self.refs.index(r)] for r in waiting]
                raise WorkerTimeoutError(f"the {self.role} worker rank(s) {ranks} (pool {self.pool!r}) did not finish {self.method} within "
                                         f"{self.straggler_timeout_s} s of the other ranks (trainer.collective_timeout_s): a hung worker; {RESUME_HINT}",
                                         tuple(ranks))
            for ref in ready:
                done[ref] = self._get(ref)
            if straggler_deadline is None and self.straggler_timeout_s is not None:
                straggler_deadline = time.monotonic() + self.straggler_timeout_s
        return self.collect([done[r] for r in self.refs])

    def _next_due(self, waiting: list, timeout_s: float, waiting_for: str, key: str, deferred: bool) -> tuple[float, bool]:
        """The caller's deadline passed with `waiting` unfinished: ask their workers how far each
        call got (`call_progress`); raise for a late or dead one, else (when to ask again, deferred).
        Ranks of one call start it a few milliseconds apart: when some are late and others are due
        within a grace (a tenth of the deadline, at most 1 s), the error waits once for those, so that
        it names every rank that is late by then."""
        verdicts = call_progress([(_actor_of(ref), ref) for ref in waiting], timeout_s)
        finished, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
        if finished:  # finished (or failed) while probed: collected (and their errors raised) first
            return time.monotonic(), deferred
        rank_of = {ref: self.ranks[self.refs.index(ref)] for ref in waiting}
        dead = [(rank_of[ref], why) for ref, (kind, why) in zip(waiting, verdicts) if kind == "dead"]
        if dead:
            rank, why = dead[0]
            raise WorkerDiedError(f"the {self.role} worker rank {rank} (pool {self.pool!r}) during {self.method} died: {why}; {RESUME_HINT}",
                                  (rank,))
        late = [(rank_of[ref], why) for ref, (kind, why) in zip(waiting, verdicts) if kind == "late"]
        soon = [after for kind, after in verdicts if kind == "wait" and after <= min(1.0, 0.1 * timeout_s)]
        if late and soon and not deferred:
            return time.monotonic() + max(soon), True
        if late:
            ranks = [rank for rank, _ in late]
            how = "; ".join(f"rank {rank} {why}" for rank, why in late if why)
            raise WorkerTimeoutError(
                f"{waiting_for or self.method}: the {self.role} worker rank(s) {ranks} (pool {self.pool!r}) did not finish "
                f"{self.method} within {timeout_s} s ({key or 'the deadline'}; submitted {time.monotonic() - self.submitted:.0f} s "
                f"ago{'; ' + how if how else ''}): a hung or too slow worker; raise the limit for longer calls; {RESUME_HINT}", tuple(ranks))
        return time.monotonic() + min(after for _, after in verdicts), deferred

    def _get(self, ref) -> Any:
        rank = self.ranks[self.refs.index(ref)]
        where = f"the {self.role} worker rank {rank} (pool {self.pool!r}) during {self.method}"
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            cause = _first_line(e)
            raise WorkerDiedError(f"{where} died: {cause}; {RESUME_HINT}", (rank,)) from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            lines = [line for line in str(cause).strip().splitlines() if line.strip()]
            raise WorkerCallError(f"{where} raised {type(cause).__name__}: {lines[-1] if lines else ''}") from e


class RoleView:
    """One role of a colocated group, with its methods under their own names."""

    def __init__(self, group: RayWorkerGroup, role: str, role_cls: type):
        self.world_size = group.world_size
        self.pool = group.pool
        self._group, self._role = group, role
        for method in registered_methods(role_cls):
            setattr(self, method, getattr(group, f"{role}__{method}"))

    def submit(self, method: str, *args, **kwargs) -> Pending:
        return self._group.submit(f"{self._role}__{method}", *args, **kwargs)


class ColocatedWorkerGroup(RayWorkerGroup):
    """Several roles (e.g. actor_rollout_ref and critic) in the same N processes."""

    def __init__(self, pool: ResourcePool, roles: dict[str, tuple[type, dict]], **kwargs):
        self.role_classes = {role: cls for role, (cls, _) in roles.items()}
        fused = colocated_worker_cls(self.role_classes)
        super().__init__(pool, fused, role_kwargs={role: kw for role, (_, kw) in roles.items()}, **kwargs)

    def role(self, name: str) -> RoleView:
        return RoleView(self, name, self.role_classes[name])
