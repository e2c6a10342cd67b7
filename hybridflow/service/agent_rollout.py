"""Multi-turn rollouts on the driver (`actor_rollout_ref.rollout.multi_turn.enable`).

The agent loop (`hybridflow/agent/loop.py`) runs every trajectory of the step on the driver's
asyncio loop; its backend call is the rollout group's request-level endpoint
(`generate_requests`: the pending requests split over the generation replicas, one batched
`generate` per replica). Tools run on the driver (the `python` tool in its OS sandbox). The
trajectories become the same batch a single-turn rollout returns, with tool tokens masked out:

    prompts [b, P] (left-padded: the chat prompt with the tool schemas), responses [b, R]
    (right-padded, R = data.max_response_length), response_mask [b, R] (1 = model token),
    input_ids / attention_mask / position_ids [b, P+R] (attention on every real token, tool
    tokens included), rollout_log_probs / rollout_untruncated_log_probs [b, R] (0 on tool tokens),
    and with async rollout rollout_policy_version [b, R] (the weights that sampled each turn).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import torch

from hybridflow.agent.loop import AgentSettings, Trajectory, run_trajectories, trajectory_metrics
from hybridflow.agent.tools import load_tool_config
from hybridflow.config.schema import AgentConfig, MultiTurnConfig
from hybridflow.protocol import Batch, SamplingParams
from hybridflow.rollout.base import rollout_batch


def agent_settings(mt: MultiTurnConfig, max_response_length: int, agent: AgentConfig | None = None, max_prompt_length: int = 0,
                   model_name: str = "policy") -> AgentSettings:
    """mt: actor_rollout_ref.rollout.multi_turn; max_response_length: data.max_response_length (the trajectory's token budget);
    agent: actor_rollout_ref.rollout.agent (a black-box agent through the OpenAI-compatible endpoint, served as model_name)."""
    black_box = endpoint = None
    if agent is not None and (agent.function or agent.command):
        from hybridflow.agent.openai_agent import BlackBoxAgent
        from hybridflow.agent.openai_server import EndpointSettings

        black_box = BlackBoxAgent(agent.function, agent.command, agent.timeout_s, agent.sandbox, tuple(agent.sandbox_paths or ()))
        endpoint = EndpointSettings(model_name, max_response_length, max_prompt_length, mt.format, agent.host, agent.port,
                                    agent.max_request_bytes, agent.max_messages, unix_socket=agent.sandbox,
                                    max_session_concurrency=agent.max_session_concurrency,
                                    max_session_requests=agent.max_session_requests,
                                    max_session_segments=agent.max_session_segments,
                                    max_session_tokens=agent.max_session_tokens or 4 * max_response_length)
    return AgentSettings(mt.max_assistant_turns, mt.max_tool_response_length, mt.format, max_response_length, mt.default_agent, black_box, endpoint,
                         mt.tool_timeout_s)


def trajectories_to_batch(trajs: list[Trajectory], pad_id: int, params: SamplingParams) -> Batch:
    """The rollout batch of `trajs` (shapes in the module docstring; R = params.max_new_tokens)."""
    b, R = len(trajs), params.max_new_tokens
    P = max(len(t.prompt_ids) for t in trajs)
    prompts = torch.full((b, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((b, P), dtype=torch.long)
    responses = torch.full((b, R), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, R), dtype=torch.long)
    logps = torch.zeros((b, R), dtype=torch.float32)
    untruncated = torch.zeros((b, R), dtype=torch.float32)
    lengths = torch.tensor([len(t.response_ids) for t in trajs])
    for i, t in enumerate(trajs):
        n = len(t.response_ids)
        assert n <= R, f"trajectory of {n} response tokens exceeds the budget {R}"
        prompts[i, P - len(t.prompt_ids):] = torch.tensor(t.prompt_ids)
        prompt_mask[i, P - len(t.prompt_ids):] = 1
        responses[i, :n] = torch.tensor(t.response_ids, dtype=torch.long)
        loss_mask[i, :n] = torch.tensor(t.response_mask, dtype=torch.long)
        logps[i, :n] = torch.tensor(t.log_probs, dtype=torch.float32)
        untruncated[i, :n] = torch.tensor(t.untruncated_log_probs, dtype=torch.float32)
    out = rollout_batch(prompts, prompt_mask, responses, logps, lengths, params, loss_mask=loss_mask, untruncated_log_probs=untruncated)
    if any(v >= 0 for t in trajs for v in t.versions):  # the driver tracked which weights sampled each turn (async rollout)
        versions = torch.full((b, R), -1, dtype=torch.long)
        for i, t in enumerate(trajs):
            versions[i, : len(t.versions)] = torch.tensor(t.versions, dtype=torch.long)
        out["rollout_policy_version"] = versions  # [b, R]
    return out


class AgentRollout:
    """The step's multi-turn rollouts through a rollout group (`generate_requests`)."""

    def __init__(self, multi_turn: MultiTurnConfig, max_response_length: int, tokenizer: Any, agent: AgentConfig | None = None,
                 max_prompt_length: int = 0, model_name: str = "policy"):
        self.tokenizer = tokenizer
        self.settings = agent_settings(multi_turn, max_response_length, agent, max_prompt_length, model_name)
        path = multi_turn.tool_config_path
        self.tools = load_tool_config(path) if path else []
        self.last: list[Trajectory] = []

    def generate(self, group: Any, prompts: Batch, params: SamplingParams) -> Batch:
        """prompts: the rows' raw_prompt (chat messages) and extra_info (tools_kwargs, env, agent_name)."""

        def generate_fn(requests: list) -> list:
            out = group.generate_requests(Batch.from_dict(non_tensors={"request": requests}))
            return list(out["completion"])

        trajs, batcher = asyncio.run(run_trajectories(agent_rows(prompts), generate_fn, self.tokenizer, self.settings, params, self.tools))
        return self.to_batch(trajs, params, batcher.calls, batcher.take_latencies())

    def to_batch(self, trajs: list[Trajectory], params: SamplingParams, generate_calls: int, latencies: list[float] = ()) -> Batch:
        """The rollout batch of the step's trajectories (in row order), their rewards and agent/* metrics
        (latencies: its model turns', seconds)."""
        self.last = trajs
        out = trajectories_to_batch(trajs, int(self.tokenizer.pad_token_id), params.with_(max_new_tokens=self.settings.response_budget))
        out["agent_reward"] = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        out.meta["metrics"] = trajectory_metrics(trajs, generate_calls=generate_calls, latencies=latencies)
        return out


def agent_rows(prompts: Batch) -> list[dict]:
    """The rows a batch's trajectories start from: raw_prompt (chat messages) and extra_info (tools_kwargs, env, agent_name)."""
    return [{"raw_prompt": list(prompts["raw_prompt"][i]), "extra_info": dict(prompts["extra_info"][i] or {})} for i in range(len(prompts))]


def served_model_name(path: str) -> str:
    """The name the agent endpoint serves the policy as: the model directory's name (what /v1/models lists)."""
    return os.path.basename(os.path.normpath(path)) or "policy"
