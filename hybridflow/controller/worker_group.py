"""The single controller's handle on a group of SPMD workers running as Ray actors.

    pool = ResourcePool(nnodes=1, procs_per_node=2, cpus_per_worker=0.5)
    wg = RayWorkerGroup(pool, ActorRolloutRefWorker, config=cfg)
    wg.init_model()                  # ONE_TO_ALL: every rank runs it
    out = wg.generate_sequences(b)   # DP_COMPUTE: b split by rank, results concatenated

Every method a worker class marks with `@register(...)` becomes a method of the group. Workers
of one group join one torch.distributed process group; rank 0 proposes the rendezvous address.
Fractional CPU requests let N workers plus the driver share a small machine without deadlock.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from hybridflow.config.schema import DEFAULT_WORKER_ENV, PoolSpec
from hybridflow.controller.decorator import LAYOUT_ATTR, Dispatch, collect_results, dispatch_args
from hybridflow.config.pools import bundle, missing_resources
from hybridflow.controller.worker import colocated_worker_cls, registered_methods

# Read by Ray at import time: without it Ray swaps a 127.0.0.1 node address for the machine's
# routable IP and its servers listen on every interface. With it, a local cluster stays on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


class _LazyRay:
    """`ray`, imported at its first use: importing this module (and the trainer above it) needs no
    Ray, so a torchrun-only install (trainer.launcher=torchrun: one node, no Ray) works without it."""

    def __getattr__(self, name: str) -> Any:
        import ray

        return getattr(ray, name)


ray = _LazyRay()


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
        remote_cls = ray.remote(worker_cls)
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

    def replace_worker(self, rank: int) -> None:
        """Kill rank `rank`'s actor and start a new one in its slot (same placement bundle, class,
        arguments and environment; named `<name>_<rank>_r<n>`, n counting this group's
        replacements). It joins no process group: only workers that need none (a generation
        replica of one process) can be replaced."""
        remote_cls, init_kwargs, options = self._start
        ray.kill(self.workers[rank], no_restart=True)
        self.replaced += 1
        self.workers[rank] = remote_cls.options(**{**options[rank], "name": f"{options[rank]['name']}_r{self.replaced}"}).remote(**init_kwargs)

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


RESUME_HINT = ("re-run the same command to resume from the latest checkpoint in trainer.default_local_dir "
               "(trainer.resume_mode=auto; checkpoints every trainer.save_freq steps)")


class Pending:
    """A worker-group call in flight (Ray object refs) and how to collect its results.

    `result()` collects the ranks as they finish, so a rank that dies or raises is reported at
    once, naming role, rank and pool, while the other ranks may still wait in a collective for it.
    Once a rank has finished, the others get `straggler_timeout_s` to finish too; a rank stuck
    outside any collective (which would time out by itself) is then reported instead of waited for."""

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
        """The collected results. timeout_s: the most this wait may take (None: no limit but the
        stragglers' one); past it a WorkerTimeoutError names `waiting_for` (what the caller waits
        for), the ranks still running, the pool, how long since the call was submitted and `key`,
        the config key that sets the limit."""
        done: dict = {}
        waiting = list(self.refs)
        straggler_deadline = None
        overall = None if timeout_s is None else time.monotonic() + timeout_s
        while waiting:
            deadlines = [d for d in (straggler_deadline, overall) if d is not None]
            timeout = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=timeout)
            if not ready:
                ranks = [self.ranks[self.refs.index(r)] for r in waiting]
                if overall is not None and (straggler_deadline is None or overall <= straggler_deadline):  # the caller's deadline came first
                    raise WorkerTimeoutError(
                        f"{waiting_for or self.method}: the {self.role} worker rank(s) {ranks} (pool {self.pool!r}) did not finish "
                        f"{self.method} within {timeout_s} s ({key or 'the deadline'}; submitted {time.monotonic() - self.submitted:.0f} s "
                        f"ago): a hung or too slow worker; raise the limit for longer calls; {RESUME_HINT}", tuple(ranks))
                raise WorkerTimeoutError(f"the {self.role} worker rank(s) {ranks} (pool {self.pool!r}) did not finish {self.method} within "
                                         f"{self.straggler_timeout_s} s of the other ranks (trainer.collective_timeout_s): a hung worker; {RESUME_HINT}",
                                         tuple(ranks))
            for ref in ready:
                done[ref] = self._get(ref)
            if straggler_deadline is None and self.straggler_timeout_s is not None:
                straggler_deadline = time.monotonic() + self.straggler_timeout_s
        return self.collect([done[r] for r in self.refs])

    def _get(self, ref) -> Any:
        rank = self.ranks[self.refs.index(ref)]
        where = f"the {self.role} worker rank {rank} (pool {self.pool!r}) during {self.method}"
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
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
