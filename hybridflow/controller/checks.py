"""The resource-pool check of the config validator (registered on import; the validator names this
module in `hybridflow.config.validate.CHECK_MODULES`): unknown roles or pools, empty pools, role
layouts a pool cannot hold, and how many ranks each role runs on (`resource_pool.py` holds the rules)."""

from __future__ import annotations

from hybridflow.config.schema import HybridFlowConfig
from hybridflow.config.validate import Workers, register_check
from hybridflow.config import pools as rp


@register_check("pools")
def pool_workers(cfg: HybridFlowConfig, kind: str) -> tuple[list[str], Workers | None]:
    """(problems, ranks per role); kind "dpo" runs `hybridflow dpo`'s roles, "rl" the active RL roles."""
    roles = rp.run_roles(cfg, kind)
    problems = rp.pool_problems(cfg, roles)
    if problems:
        return problems, None
    gen = rp.Role.ROLLOUT if cfg.trainer.async_rollout else rp.Role.ACTOR_ROLLOUT
    return [], Workers(actor=rp.role_world_size(cfg, rp.Role.ACTOR_ROLLOUT, roles), gen=rp.role_world_size(cfg, gen, roles),
                       critic=rp.role_world_size(cfg, rp.Role.CRITIC, roles))
