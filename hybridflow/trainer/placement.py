"""The one worker-group factory: RL and DPO, SFT, reward-model training and model stages.

    placed = start_groups(cfg.trainer, cfg.ray_init, {"global_pool": PoolSpec(workers_per_node=2)},
                          lambda pool, procs_per_node: {"actor": (ActorRolloutRefWorker, kwargs)})
    actor = placed.groups["global_pool"].role("actor")
    ...
    placed.shutdown()   # the groups, then the pools they reserved

trainer.launcher=ray: start (or join) Ray, check every pool against the cluster and reserve it with
placement groups (`place_pools`: a resource the cluster lacks is a ConfigError naming the pool,
never a hang), then one `ColocatedWorkerGroup` per pool holding the roles `classes(pool,
procs_per_node)` returns, with trainer.worker_env and trainer.collective_timeout_s. A failure
releases whatever was already placed.

trainer.launcher=torchrun: this process is one rank of the run's one pool (`LocalColocatedGroup`,
controller/local_group.py); WORLD_SIZE must equal trainer.nnodes x trainer.n_gpus_per_node. Every
rank runs the driver: files are written where `is_main`, the others wait at `barrier()`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hybridflow.config import ConfigError
from hybridflow.config.schema import PoolSpec, RayInitConfig, TrainerConfig
from hybridflow.parallel.process_group import pick_device

RoleClasses = dict[str, tuple[type, dict]]  # view name -> (worker class, its keyword arguments)


class WorkerGroups:
    """The worker groups of a run (by pool name) and the pools they reserved (Ray only)."""

    def __init__(self, torchrun: bool):
        self.torchrun = torchrun
        self.groups: dict[str, Any] = {}
        self.pools: dict[str, Any] = {}

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run's files (torchrun: rank 0; Ray: the one driver)."""
        return not self.torchrun or torch.distributed.get_rank() == 0

    def barrier(self) -> None:
        if self.torchrun:
            torch.distributed.barrier()

    def views(self) -> dict[str, Any]:
        """Every role of every group under its view name ("actor", "critic", ...)."""
        return {role: g.role(role) for g in self.groups.values() for role in g.role_classes}

    def shutdown(self) -> None:
        for name in list(self.groups):
            self.groups.pop(name).shutdown()
        for name in list(self.pools):  # also a pool whose group failed to start
            self.pools.pop(name).release()


def start_groups(t: TrainerConfig, ri: RayInitConfig, specs: dict[str, PoolSpec], classes: Callable[[str, int], RoleClasses],
                 name: Callable[[str], str] = lambda pool: pool, launcher: str | None = None) -> WorkerGroups:
    """One worker group per pool of `specs`; classes(pool, procs_per_node): the roles it holds;
    name(pool): the group's name (its Ray actors are `<name>_<rank>`); launcher: default
    trainer.launcher."""
    device = pick_device(t.device)
    placed = WorkerGroups(torchrun=(launcher or t.launcher) == "torchrun")
    if placed.torchrun:
        _start_torchrun(placed, t, specs, classes, device)
        return placed
    from hybridflow.controller.worker_group import ColocatedWorkerGroup, init_ray, place_pools

    init_ray(ri.address, ri.num_cpus, ri.resources or None)
    # Checked against the cluster before any placement group or worker: never a hang.
    placed.pools = place_pools(specs, ri.cpus_per_worker, device)
    try:
        for pool_name, pool in placed.pools.items():
            placed.groups[pool_name] = ColocatedWorkerGroup(pool, classes(pool_name, pool.procs_per_node), name=name(pool_name), device=device,
                                                            worker_env=t.worker_env, straggler_timeout_s=t.collective_timeout_s)
    except BaseException:
        placed.shutdown()  # release every pool and the groups already started
        raise
    return placed


def _start_torchrun(placed: WorkerGroups, t: TrainerConfig, specs: dict[str, PoolSpec], classes: Callable[[str, int], RoleClasses],
                    device: str) -> None:
    """Every rank is a worker of the one pool, in this process."""
    from hybridflow.controller.local_group import LocalColocatedGroup
    from hybridflow.parallel.process_group import init_torchrun

    if len(specs) != 1:
        raise ConfigError(f"trainer.launcher=torchrun runs every role in the torchrun processes (one pool), not the pools {sorted(specs)}; "
                          f"launch with Ray (trainer.launcher=ray)")
    _, world = init_torchrun(device, t.collective_timeout_s)
    if world != t.nnodes * t.n_gpus_per_node:
        raise ConfigError(f"torchrun started {world} processes but trainer.nnodes * trainer.n_gpus_per_node = "
                          f"{t.nnodes} * {t.n_gpus_per_node}; make them equal (--nnodes / --nproc_per_node)")
    (pool_name,) = specs
    # torchrun numbers the ranks of a node consecutively, n_gpus_per_node of them (checked above)
    placed.groups[pool_name] = LocalColocatedGroup(classes(pool_name, t.n_gpus_per_node), name=pool_name)
