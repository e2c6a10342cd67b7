"""Roles and resource pools as data (verl's ResourcePoolManager shape).

    resource_pool:
      pools:
        actor_pool:  {workers_per_node: 2}
        critic_pool: {workers_per_node: 1, resources: {H100: 1}}
      mapping: {actor_rollout: actor_pool, ref: actor_pool, critic: critic_pool}

A pool is `nnodes` x `workers_per_node` worker processes; each reserves a bundle of Ray resources
(CPUs, GPUs, custom labels, an accelerator type). Roles mapped to the same pool are colocated in
one process per rank (one torch.distributed group); roles on different pools get their own
processes and group, and their stages may run at the same time. Everything here is pure Python
and runs before any worker starts: `pool_problems` is part of the config validator,
`missing_resources` compares the pools with what a running Ray cluster has.
"""

from __future__ import annotations

import enum
from typing import Any

from hybridflow.config.schema import DEFAULT_POOL, ROLES, HybridFlowConfig, PoolSpec


class Role(str, enum.Enum):
    ACTOR_ROLLOUT = "actor_rollout"  # the trained policy and (unless async) its colocated rollout
    ROLLOUT = "rollout"  # a generation-only pool (trainer.async_rollout)
    REF = "ref"  # the frozen reference policy
    CRITIC = "critic"
    REWARD_MODEL = "reward_model"  # a sequence-classifier reward model (reward_model.enable)
    TEACHER = "teacher"  # on-policy distillation's teacher (teacher.enable)


assert tuple(r.value for r in Role) == ROLES


class ModelPart(str, enum.Enum):
    """What one policy-model worker process (ActorRolloutRefWorker) holds: the trained actor, its
    generation layout (the colocated rollout, unless the rollout has a pool of its own), the frozen
    reference. A worker holds the actor with any of the others, or the reference alone."""

    ACTOR = "actor"
    ROLLOUT = "rollout"
    REF = "ref"


def worker_role(parts: frozenset[ModelPart]) -> str:
    """The ActorRolloutRefWorker's `role` string for `parts`: "actor_rollout_ref", "actor_rollout",
    "actor_ref", "actor" or "ref"."""
    if ModelPart.ACTOR not in parts and set(parts) != {ModelPart.REF}:
        raise ValueError(f"a policy worker holds the actor (with the rollout and/or the reference) or the reference alone, "
                         f"not {sorted(p.value for p in parts)}")
    return "_".join(p.value for p in ModelPart if p in parts)


def pool_specs(cfg: HybridFlowConfig) -> dict[str, PoolSpec]:
    """The configured pools, or the default single pool from trainer.nnodes / n_gpus_per_node."""
    if cfg.resource_pool.pools:
        return dict(cfg.resource_pool.pools)
    t = cfg.trainer
    return {DEFAULT_POOL: PoolSpec(workers_per_node=t.n_gpus_per_node, nnodes=t.nnodes)}


def needs_ref_log_prob(cfg: HybridFlowConfig) -> bool:
    """A KL term (in the loss or in the reward) reads the reference policy's log-probs."""
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def ref_is_actor(cfg: HybridFlowConfig) -> bool:
    """With LoRA the reference is the actor with its adapters off: no reference role, no reference weights."""
    return needs_ref_log_prob(cfg) and cfg.actor_rollout_ref.model.lora_rank > 0


def active_roles(cfg: HybridFlowConfig) -> list[Role]:
    """The roles this algorithm runs: a critic for GAE, a reference for KL, a rollout pool when async,
    a reward model and a distillation teacher when enabled."""
    roles = [Role.ACTOR_ROLLOUT]
    if cfg.trainer.async_rollout:
        roles.append(Role.ROLLOUT)
    if needs_ref_log_prob(cfg) and not ref_is_actor(cfg):
        roles.append(Role.REF)
    if cfg.algorithm.adv_estimator == "gae":
        roles.append(Role.CRITIC)
    if cfg.reward_model.enable:
        roles.append(Role.REWARD_MODEL)
    if cfg.teacher.enable:
        roles.append(Role.TEACHER)
    return roles


def dpo_roles(cfg: HybridFlowConfig) -> list[Role]:
    """The roles of `hybridflow dpo`: the policy (its rollout validates, and samples when online),
    the reference unless its log-probs are precomputed (offline only), a reward model when online
    and enabled."""
    roles = [Role.ACTOR_ROLLOUT]
    if cfg.dpo.online or not cfg.dpo.precompute_ref_log_probs:
        roles.append(Role.REF)
    if cfg.dpo.online and cfg.reward_model.enable:
        roles.append(Role.REWARD_MODEL)
    return roles


def run_roles(cfg: HybridFlowConfig, kind: str = "rl") -> list[Role]:
    """The roles a run of `kind` places: "dpo" (`hybridflow dpo`) or "rl" (the active RL roles)."""
    return dpo_roles(cfg) if kind == "dpo" else active_roles(cfg)

def role_pools(cfg: HybridFlowConfig, roles: list[Role] | None = None) -> dict[Role, str]:
    """Active role (default: `active_roles`) -> pool name (a role missing from the mapping goes to global_pool)."""
    mapping = cfg.resource_pool.mapping
    return {role: mapping.get(role.value, DEFAULT_POOL) for role in (active_roles(cfg) if roles is None else roles)}


def world_size(spec: PoolSpec) -> int:
    return spec.nnodes * spec.workers_per_node


def role_world_size(cfg: HybridFlowConfig, role: Role, roles: list[Role] | None = None) -> int:
    """How many ranks a role runs on (its pool's size); 0 for a pool that does not exist."""
    spec = pool_specs(cfg).get(role_pools(cfg, roles).get(role, DEFAULT_POOL))
    return world_size(spec) if spec else 0


def pool_problems(cfg: HybridFlowConfig, roles: list[Role] | None = None) -> list[str]:
    """Unknown roles or pools, empty pools, and role layouts a pool cannot hold."""
    out: list[str] = []
    specs = pool_specs(cfg)
    known_roles = [r.value for r in Role]
    for role, pool in cfg.resource_pool.mapping.items():
        if role not in known_roles:
            out.append(f"resource_pool.mapping: unknown role {role!r}; roles are {known_roles}")
        if pool not in specs:
            hint = (f"pools are {sorted(specs)}" if cfg.resource_pool.pools
                    else f"define it under resource_pool.pools (without pools, the only pool is {DEFAULT_POOL!r})")
            out.append(f"resource_pool.mapping.{role}: unknown pool {pool!r}; {hint}")
    for name, spec in specs.items():
        key = f"resource_pool.pools.{name}"
        for field_name in ("workers_per_node", "nnodes"):
            v = getattr(spec, field_name)
            if not (isinstance(v, int) and v > 0):
                out.append(f"{key}.{field_name} must be a positive integer, got {v!r}")
        for res, amount in spec.resources.items():
            if not amount > 0:
                out.append(f"{key}.resources.{res} must be > 0, got {amount}")
        if spec.cpus_per_worker is not None and not spec.cpus_per_worker > 0:
            out.append(f"{key}.cpus_per_worker must be > 0, got {spec.cpus_per_worker}")
    if out:
        return out
    pools = role_pools(cfg, roles)
    for role, pool in pools.items():
        if pool not in specs:
            out.append(f"resource_pool.mapping.{role.value} is not set and {DEFAULT_POOL!r} is not among the pools {sorted(specs)}; "
                       f"map the {role.value} role to one of them (or define {DEFAULT_POOL})")
    if out:
        return out
    if cfg.trainer.async_rollout and Role.ROLLOUT in pools:
        shared = [r.value for r, p in pools.items() if p == pools[Role.ROLLOUT] and r is not Role.ROLLOUT]
        if shared:
            out.append(f"trainer.async_rollout=true: the rollout pool {pools[Role.ROLLOUT]!r} must hold only the rollout role "
                       f"(it generates during the whole step), but {shared} are mapped to it too")
    if cfg.trainer.async_rollout and Role.ROLLOUT in pools and pools[Role.ROLLOUT] == pools[Role.ACTOR_ROLLOUT]:
        out.append(f"trainer.async_rollout=true needs the rollout on a pool of its own: resource_pool.mapping.rollout "
                   f"is {pools[Role.ROLLOUT]!r}, the same pool as actor_rollout; add a pool for it and map rollout there")
    return out


def bundle(spec: PoolSpec, default_cpus: float, device: str) -> dict[str, float]:
    """The Ray resources one worker of the pool reserves."""
    out: dict[str, float] = {"CPU": spec.cpus_per_worker if spec.cpus_per_worker is not None else default_cpus}
    gpus = spec.gpus_per_worker if spec.gpus_per_worker is not None else (1.0 if device == "cuda" else 0.0)
    if gpus:
        out["GPU"] = gpus
    out.update(spec.resources)
    if spec.accelerator_type:
        out[f"accelerator_type:{spec.accelerator_type}"] = 0.001  # Ray's label: any amount pins the node type
    return out


def missing_resources(pools: dict[str, tuple[PoolSpec, dict[str, float]]], nodes: list[dict[str, Any]]) -> list[str]:
    """What the cluster (`ray.nodes()`) lacks for the pools ({name: (spec, bundle)}): every pool needs
    `nnodes` nodes that can each hold `workers_per_node` bundles, and all pools together must fit."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    out = []
    totals: dict[str, float] = {}
    for name, (spec, b) in pools.items():
        per_node = {res: amount * spec.workers_per_node for res, amount in b.items()}
        for res, amount in b.items():
            totals[res] = totals.get(res, 0.0) + amount * world_size(spec)
        fits = [n for n in alive if all(n.get(res, 0.0) >= need - 1e-9 for res, need in per_node.items())]
        if len(fits) < spec.nnodes:
            lacking = sorted({res for res, need in per_node.items() if max((n.get(res, 0.0) for n in alive), default=0.0) < need - 1e-9})
            have = {res: max((n.get(res, 0.0) for n in alive), default=0.0) for res in lacking}
            out.append(f"resource_pool.pools.{name}: needs {per_node} on each of {spec.nnodes} node(s); the Ray cluster has "
                       f"{len(fits)} such node(s) (largest per node: {have}). Missing resource(s) {lacking}: start Ray with "
                       f"them (e.g. `ray start --resources='{{\"{lacking[0] if lacking else 'X'}\": N}}'`) or change the pool's requirements")
    cluster: dict[str, float] = {}
    for n in alive:
        for res, amount in n.items():
            cluster[res] = cluster.get(res, 0.0) + amount
    if not out:
        for res, need in totals.items():
            if cluster.get(res, 0.0) < need - 1e-9:
                out.append(f"resource_pool: all pools together need {need:g} {res}, the Ray cluster has {cluster.get(res, 0.0):g}; "
                           f"shrink a pool or its per-worker requirements")
    return out
