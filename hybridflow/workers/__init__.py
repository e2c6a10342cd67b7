"""The SPMD worker classes (one Ray actor per rank, or in-process under torchrun).

Imported lazily so that `import hybridflow.workers` does not load torch/transformers:
`from hybridflow.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker, RolloutWorker`.
"""

_WHERE = {
    "ActorRolloutRefWorker": "hybridflow.workers.actor_rollout_ref",
    "CriticWorker": "hybridflow.workers.critic",
    "RewardModelWorker": "hybridflow.workers.reward_model",
    "RolloutWorker": "hybridflow.workers.rollout",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'hybridflow.workers' has no attribute {name!r}")
