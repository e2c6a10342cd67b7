"""The rollout service (trainer.async_rollout): generation on a pool of its own, ahead of training.

What the trainer sees is `RolloutService`: take the batch of a step (no token older than the
staleness bound allows), publish the weights of an update, generate for validation, stop. Inside:

- `async_rollout.py`: the scheduler: which batch is submitted when (the staleness bound, k =
  async_training.max_staleness), the weight syncs queued behind the batches, the step's metrics,
  and the bound asserted on the replicas' own record of the versions they sampled with;
- `replicas.py`: the generation replicas (one process each) that survive faults: routing, restarts
  with the latest weights, the incarnation of each replica (one owner: `ReplicaSet`);
- `managers.py`: the rollout managers (Ray actors) that run multi-turn rollouts off the driver:
  agent loops, the OpenAI-compatible endpoint, sessions, tools, environments;
- `agent_rollout.py`: multi-turn rollouts as batches (trajectories -> the trainer's tensors);
- partial rollout's segments: `rollout/partial.py` (a backend concern, used here).

The weights come from the trainer (`trainer/weight_sync.py` publishes the actor's shards into the
object store); the service queues their receipt on the replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hybridflow.protocol import Batch, SamplingParams
from hybridflow.service.agent_rollout import AgentRollout, served_model_name
from hybridflow.service.async_rollout import AsyncRollout
from hybridflow.run_plan import manager_count
from hybridflow.service.managers import ManagerPool, ManagerSpec
from hybridflow.service.replicas import ReplicaRestarted, ReplicaSet

__all__ = ["AgentRollout", "RolloutService", "ReplicaRestarted", "ReplicaSet", "rollout_replicas", "served_model_name", "start_rollout_service"]


@dataclass
class RolloutService:
    """The service as the trainer calls it; `scheduler` holds the batches in flight."""

    scheduler: AsyncRollout
    replicas: Any  # ReplicaSet (replicas of one process) or the rollout pool's view (gen_tp > 1)
    managers: ManagerPool | None  # multi-turn rollouts off the driver (None: on a driver thread per batch)
    agent: AgentRollout | None
    deadline_s: float | None  # the most one multi-turn or partial batch may take

    def take(self, step: int) -> tuple[Batch, dict[str, float]]:
        """The generated batch of `step` (trained by the step-th update) and its rollout/* metrics."""
        return self.scheduler.take(step)

    def publish(self, step: int) -> dict[str, float]:
        """The weights of update `step` -> the replicas, queued behind the batches they generate."""
        return self.scheduler.sync_weights(step)

    def generate(self, batch: Batch, params: SamplingParams, waiting_for: str, timeout_s: float | None) -> Batch:
        """Generation outside the schedule (validation): with any weights the replicas hold."""
        if self.managers is not None:
            return self.managers.submit(batch, params, 0, self.deadline_s).result(waiting_for=waiting_for)
        if self.agent is not None:
            return self.agent.generate(self.replicas, batch, params)
        from hybridflow.trainer.keys import PROMPT_KEYS

        while True:
            call = self.replicas.submit("generate_sequences", batch.select(PROMPT_KEYS), params)
            try:
                return call.result(timeout_s, waiting_for, "actor_rollout_ref.rollout.request_timeout_s")
            except ReplicaRestarted:  # a replica died and was restarted: generate again
                continue

    def stop(self) -> None:
        if self.managers is not None:
            self.managers.shutdown()
            self.managers = None


def rollout_replicas(group: Any, view: Any, spec: Any, max_restarts: int) -> Any:
    """The rollout pool `group` (its role view `view`) as the service calls it: replicas that survive
    faults (a ReplicaSet) where each is one process, else the view (a failure stops the run).
    spec: the rollout's RolloutSpec."""
    r = spec.rollout
    return ReplicaSet(group, "rollout", max_restarts, r.request_timeout_s) if r.tensor_model_parallel_size == 1 else view


def start_rollout_service(replicas: Any, spec: Any, async_training: Any, weight_sync: Any, agent: AgentRollout | None,
                          prompts: Callable[[], Batch], sampling: Callable[[int], SamplingParams], total_steps: int,
                          loader_state: Callable[[], Any], pad_id: int, max_prompt_length: int) -> RolloutService:
    """The service over `replicas` (`rollout_replicas`): the rollout managers where multi-turn rollouts
    run on them, and the scheduler. spec: the rollout's RolloutSpec (its section, model and budgets);
    async_training: the config section; weight_sync: publishes the trainer's weights (`publish_for_rollout`);
    prompts / sampling / loader_state: the next batch's prompts, a step's sampling parameters, the
    loader's position; agent: the multi-turn rollout (None: single-turn)."""
    r = spec.rollout
    partial = async_training.partial_rollout_chunk if async_training.partial_rollout else None
    deadline = batch_deadline_s(r, async_training.max_replica_restarts)
    managers = None
    n = manager_count(r.agent, agent is not None, True, r.tensor_model_parallel_size)
    if n and isinstance(replicas, ReplicaSet):
        mspec = ManagerSpec(r.multi_turn, r.agent, spec.max_new_tokens, max_prompt_length, spec.model.tokenizer_source(),
                            served_model_name(spec.model.path), "rollout", r.request_timeout_s, sampling(0), partial)
        managers = ManagerPool(mspec, n, replicas, async_training.max_replica_restarts, agent)
    scheduler = AsyncRollout(replicas, weight_sync, prompts, sampling, total_steps, async_training.max_staleness, r.request_timeout_s,
                             loader_state, agent, partial, pad_id, deadline, managers)
    return RolloutService(scheduler, replicas, managers, agent, deadline)


def batch_deadline_s(rollout: Any, max_restarts: int) -> float | None:
    """The most one multi-turn or partial batch may take: its longest trajectory's turns, each a request
    and a tool call under their deadlines (a black-box agent: its own), once more per replica restart."""
    if rollout.request_timeout_s is None:
        return None
    mt, agent = rollout.multi_turn, rollout.agent
    longest = mt.max_assistant_turns * (rollout.request_timeout_s + mt.tool_timeout_s) if mt.enable else rollout.request_timeout_s
    if agent.function or agent.command:
        longest = max(longest, agent.timeout_s + rollout.request_timeout_s)
    return longest * (1 + max_restarts)
