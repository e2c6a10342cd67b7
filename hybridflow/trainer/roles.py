"""The roles a run places, computed once from the config, and the worker classes that hold them.

    roles = RunRoles.of(cfg, "rl")        # {Role: pool name}: the layout, before any worker starts
    roles.use_critic, roles.use_ref, roles.use_rm, roles.pool_of(Role.ACTOR_ROLLOUT)
    role_classes(plan, roles, roles.on(pool), total_steps)  # {view name: (class, kwargs)}, each role's spec from the plan

Which roles run: `resource_pool.active_roles` for RL (a critic for GAE, a reference for KL, a
rollout pool when async, a reward model and a distillation teacher when enabled), `resource_pool.dpo_roles` for DPO. Roles are
`Role` members everywhere on the driver; the policy worker's role string is made in one place,
`policy_worker`, from the `ModelPart`s it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.config.schema import HybridFlowConfig
from hybridflow.config.pools import ModelPart, Role, ref_is_actor, role_pools, run_roles
from hybridflow.run_plan import ActorSpec, RunPlan


@dataclass(frozen=True)
class RunRoles:
    """The roles of one run and the pool each is placed on (in placement order)."""

    pools: dict[Role, str] = field(default_factory=dict)
    async_rollout: bool = False  # the rollout role generates on a pool of its own
    ref_in_actor: bool = False  # LoRA: the actor computes reference log-probs with its adapters off

    @classmethod
    def of(cls, cfg: HybridFlowConfig, kind: str = "rl") -> "RunRoles":
        return cls(role_pools(cfg, run_roles(cfg, kind)), cfg.trainer.async_rollout, kind == "rl" and ref_is_actor(cfg))

    @property
    def roles(self) -> list[Role]:
        return list(self.pools)

    def __contains__(self, role: Role) -> bool:
        return role in self.pools

    def pool_of(self, role: Role) -> str:
        return self.pools[role]

    def pool_names(self) -> list[str]:
        """The pools the run uses, each once, in the order of their first role."""
        return list(dict.fromkeys(self.pools.values()))

    def on(self, pool: str) -> list[Role]:
        """The roles colocated on `pool` (one process per rank holds them all)."""
        return [role for role, p in self.pools.items() if p == pool]

    @property
    def use_critic(self) -> bool:
        return Role.CRITIC in self.pools

    @property
    def use_ref(self) -> bool:
        return Role.REF in self.pools

    @property
    def ref_log_prob(self) -> bool:
        """Reference log-probs are computed: by a reference role, or by the actor (LoRA)."""
        return self.use_ref or self.ref_in_actor

    @property
    def use_rm(self) -> bool:
        return Role.REWARD_MODEL in self.pools

    @property
    def use_teacher(self) -> bool:
        return Role.TEACHER in self.pools


def policy_worker(spec: ActorSpec, parts: set[ModelPart] | frozenset[ModelPart], **kwargs) -> tuple[type, dict]:
    """The policy-model worker holding `parts` (typed: the worker reads the ModelPart set), and its arguments."""
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker

    return ActorRolloutRefWorker, {"spec": spec, "role": frozenset(parts), **kwargs}


def role_classes(plan: RunPlan, run: RunRoles, here: list[Role], total_steps: int) -> dict[str, tuple[type, dict]]:
    """The worker classes (and their arguments) that hold the roles `here` in one process, by view
    name; each gets its spec from `plan` (with its pool's layout)."""
    from hybridflow.workers.critic import CriticWorker
    from hybridflow.workers.reward_model import RewardModelWorker
    from hybridflow.workers.rollout import RolloutWorker
    from hybridflow.workers.teacher import TeacherWorker

    classes: dict[str, tuple[type, dict]] = {}
    if Role.ACTOR_ROLLOUT in here:
        parts = {ModelPart.ACTOR} | ({ModelPart.ROLLOUT} if not run.async_rollout else set()) | ({ModelPart.REF} if Role.REF in here else set())
        classes["actor"] = policy_worker(plan.actor, parts, total_training_steps=total_steps)
    elif Role.REF in here:
        classes["ref"] = policy_worker(plan.actor, {ModelPart.REF})
    if Role.ROLLOUT in here:
        classes["rollout"] = (RolloutWorker, {"spec": plan.rollout})
    if Role.CRITIC in here:
        classes["critic"] = (CriticWorker, {"spec": plan.critic, "total_training_steps": total_steps})
    if Role.REWARD_MODEL in here:
        classes["reward_model"] = (RewardModelWorker, {"spec": plan.reward_model})
    if Role.TEACHER in here:
        classes["teacher"] = (TeacherWorker, {"spec": plan.teacher})
    return classes
