"""Multi-turn rollouts (`actor_rollout_ref.rollout.multi_turn.enable`), on the driver or packed by rollout managers.

On the driver (`actor_rollout_ref.rollout.agent.num_workers=0`): the agent loop (`hybridflow/agent/loop.py`) runs every trajectory of the step on the driver's
asyncio loop; its backend call is the rollout group's request-level endpoint
(`generate_requests`: the pending requests split over the generation replicas, one batched
`generate` per replica). Tools run on the driver (the `python` tool in its OS sandbox). The
trajectories become the same batch a single-turn rollout returns, with tool tokens masked out:

    prompts [b, P] (left-padded: the chat prompt with the tool schemas), responses [b, R]
    (right-padded, R = data.max_response_length), response_mask [b, R] (1 = model token),
    input_ids / attention_mask / position_ids [b, P+R] (attention on every real token, tool
    tokens included), rollout_log_probs / rollout_untruncated_log_probs [b, R] (0 on tool tokens),
    and with async rollout rollout_policy_version [b, R] (the weights that sampled each turn).

A vision-language policy (`models/vlm.py::is_vlm_dir`): the processor is loaded from the checkpoint, a row's
trajectory starts from its prompt with its images (`<image>` placeholders, the batch's `multi_modal_data`), a tool's or
environment's images join it (agent/images.py), and the batch adds each row's `multi_modal_inputs` (the trajectory's
pixel inputs in order: the prompt's, then the messages') with position_ids as the M-RoPE index [b, 3, P+R].

On rollout managers (service/managers.py) each manager packs its shard (`AgentRollout.pack`: tensors,
the agent/* metrics' sums) and the driver merges the packs (`AgentRollout.merge`): the same batch,
with nothing per trajectory or per turn left on the driver.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.agent.loop import AgentSettings, Trajectory, add_totals, metrics_from_totals, run_trajectories, trajectory_totals
from hybridflow.agent.tools import load_tool_config
from hybridflow.config.schema import AgentConfig, MultiTurnConfig
from hybridflow.protocol import Batch, SamplingParams
from hybridflow.rollout.base import left_padded, rollout_batch


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


@dataclass
class PackedTrajectories:
    """Trajectories as tensors: what a rollout manager sends the driver for its shard, so that the
    driver unpickles a few tensors per shard, not a thousand Python lists (R = the response budget):

        prompts / prompt_mask [b, P] (left-padded, P = the longest prompt here), responses [b, R]
        (right-padded), loss_mask [b, R] (1 = model token), log_probs / untruncated_log_probs [b, R]
        (0 on tool tokens), versions [b, R] (the policy version per token, -1 unknown), lengths [b],
        rewards [b] (the tools' / environment's), totals (trajectory_totals: the agent/* metrics' sums)."""

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    responses: torch.Tensor
    loss_mask: torch.Tensor
    log_probs: torch.Tensor
    untruncated_log_probs: torch.Tensor
    versions: torch.Tensor
    lengths: torch.Tensor
    rewards: torch.Tensor
    totals: dict[str, float]

    def __reduce__(self):
        # Pickled as numpy arrays: Ray sends those out of band (no copy into the pickle stream), where a
        # torch tensor goes through torch's own storage serialisation (half the driver's remaining CPU per batch).
        arrays = [getattr(self, f.name).numpy() for f in dataclasses.fields(self) if f.name != "totals"]
        return _unpack, (arrays, self.totals)


def _unpack(arrays: list, totals: dict[str, float]) -> PackedTrajectories:
    """PackedTrajectories from its pickled arrays (copied once: Ray's out-of-band buffers are read-only)."""
    return PackedTrajectories(*(torch.from_numpy(np.array(a)) for a in arrays), totals=totals)


def pack_trajectories(trajs: Sequence[Trajectory], pad_id: int, R: int) -> PackedTrajectories:
    """`trajs` (in row order) as tensors (shapes in PackedTrajectories; R = the response budget)."""
    b = len(trajs)
    prompts, prompt_mask = left_padded([t.prompt_ids for t in trajs], pad_id)  # [b, P]
    responses = torch.full((b, R), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, R), dtype=torch.long)
    logps = torch.zeros((b, R), dtype=torch.float32)
    untruncated = torch.zeros((b, R), dtype=torch.float32)
    versions = torch.full((b, R), -1, dtype=torch.long)
    for i, t in enumerate(trajs):
        n = len(t.response_ids)
        assert n <= R, f"trajectory of {n} response tokens exceeds the budget {R}"
        responses[i, :n] = torch.tensor(t.response_ids, dtype=torch.long)
        loss_mask[i, :n] = torch.tensor(t.response_mask, dtype=torch.long)
        logps[i, :n] = torch.tensor(t.log_probs, dtype=torch.float32)
        untruncated[i, :n] = torch.tensor(t.untruncated_log_probs, dtype=torch.float32)
        versions[i, : len(t.versions)] = torch.tensor(t.versions, dtype=torch.long)
    lengths = torch.tensor([len(t.response_ids) for t in trajs], dtype=torch.long)
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    return PackedTrajectories(prompts, prompt_mask, responses, loss_mask, logps, untruncated, versions, lengths, rewards, trajectory_totals(trajs))


def merge_packed(parts: Sequence[tuple[Sequence[int], PackedTrajectories]], pad_id: int) -> PackedTrajectories:
    """Shards' packs as one, row j of a shard at its row index rows[j]; prompts left-padded again to
    the longest of all (the batch the driver would have packed from every trajectory itself)."""
    n = sum(len(rows) for rows, _ in parts)
    P = max(p.prompts.shape[1] for _, p in parts)
    R = parts[0][1].responses.shape[1]
    prompts = torch.full((n, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, P), dtype=torch.long)
    merged = {k: torch.empty((n, R), dtype=getattr(parts[0][1], k).dtype)
              for k in ("responses", "loss_mask", "log_probs", "untruncated_log_probs", "versions")}
    lengths, rewards = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.float32)
    for rows, part in parts:
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        width = part.prompts.shape[1]
        prompts[idx, P - width:] = part.prompts
        prompt_mask[idx, P - width:] = part.prompt_mask
        for k, t in merged.items():
            t[idx] = getattr(part, k)
        lengths[idx], rewards[idx] = part.lengths, part.rewards
    return PackedTrajectories(prompts, prompt_mask, lengths=lengths, rewards=rewards, totals=add_totals([p.totals for _, p in parts]), **merged)


def packed_to_batch(packed: PackedTrajectories, params: SamplingParams) -> Batch:
    """The rollout batch of packed trajectories (shapes in the module docstring; R = params.max_new_tokens)."""
    out = rollout_batch(packed.prompts, packed.prompt_mask, packed.responses, packed.log_probs, packed.lengths, params,
                        loss_mask=packed.loss_mask, untruncated_log_probs=packed.untruncated_log_probs)
    if bool((packed.versions >= 0).any()):  # the replicas stamped which weights sampled each turn (async rollout)
        out["rollout_policy_version"] = packed.versions  # [b, R]
    return out


def trajectories_to_batch(trajs: list[Trajectory], pad_id: int, params: SamplingParams, model_config: Any = None) -> Batch:
    """The rollout batch of `trajs` (shapes in the module docstring; R = params.max_new_tokens). model_config: a VLM's
    (agent/images.py): each row's images travel as its `multi_modal_inputs` (the single-turn VLM rows' key and shapes) and
    position_ids become the M-RoPE index [b, 3, P+R], so the trainer's log-prob pass sees the images the rollout saw."""
    out = packed_to_batch(pack_trajectories(trajs, pad_id, params.max_new_tokens), params)
    return with_images(out, trajs, model_config) if model_config is not None else out


def with_images(out: Batch, trajs: Sequence[Trajectory], model_config: Any) -> Batch:
    """`out` (the rollout batch of `trajs`, in row order) with each row's images: `multi_modal_inputs` per row
    ({"pixel_values": [P_i, D], "image_grid_thw": [n_i, 3]}, {} without images) and position_ids the M-RoPE index
    [b, 3, P+R] over prompt + response (the single-turn VLM rows' layout)."""
    from hybridflow.data.vision import MULTI_MODAL_KEY, rows_position_ids

    rows = [t.multi_modal_inputs for t in trajs]
    out["position_ids"] = rows_position_ids(model_config, out["input_ids"], out["attention_mask"], rows)  # [b, 3, P+R]
    out[MULTI_MODAL_KEY] = rows
    return out


class AgentRollout:
    """The step's multi-turn rollouts through a rollout group (`generate_requests`)."""

    model_config: Any = None  # a vision-language policy's HF config (its rope index for the batch); None: a text policy

    def __init__(self, multi_turn: MultiTurnConfig, max_response_length: int, tokenizer: Any, agent: AgentConfig | None = None,
                 max_prompt_length: int = 0, model_name: str = "policy", model_path: str = ""):
        """model_path: the policy's checkpoint; a vision-language one's processor and config are loaded from it (images in
        the prompts, tools' and environments' messages, and the batch)."""
        self.tokenizer = tokenizer
        self.settings = agent_settings(multi_turn, max_response_length, agent, max_prompt_length, model_name)
        if model_path:
            from hybridflow.models.vlm import is_vlm_dir, load_processor

            if is_vlm_dir(model_path):
                from transformers import AutoConfig

                self.settings = dataclasses.replace(self.settings, processor=load_processor(model_path))
                self.model_config = AutoConfig.from_pretrained(model_path)
        path = multi_turn.tool_config_path
        self.tools = load_tool_config(path) if path else []
        self._last: list[Trajectory] | None = []
        self._last_parts: list[tuple[Sequence[int], Any]] | None = None

    def generate(self, group: Any, prompts: Batch, params: SamplingParams) -> Batch:
        """prompts: the rows' raw_prompt (chat messages) and extra_info (tools_kwargs, env, agent_name)."""

        def generate_fn(requests: list) -> list:
            out = group.generate_requests(Batch.from_dict(non_tensors={"request": requests}))
            return list(out["completion"])

        trajs, batcher = asyncio.run(run_trajectories(agent_rows(prompts), generate_fn, self.tokenizer, self.settings, params, self.tools))
        return self.to_batch(trajs, params, batcher.calls, batcher.take_latencies())

    def to_batch(self, trajs: list[Trajectory], params: SamplingParams, generate_calls: int, latencies: Sequence[float] = ()) -> Batch:
        """The rollout batch of the step's trajectories (in row order), their rewards and agent/* metrics
        (latencies: its model turns', seconds)."""
        self._last, self._last_parts = trajs, None
        out = self.from_packed(self.pack(trajs), params, generate_calls, latencies)
        return with_images(out, trajs, self.model_config) if self.model_config is not None else out

    def pack(self, trajs: Sequence[Trajectory]) -> PackedTrajectories:
        """`trajs` as tensors, R = the trajectories' token budget (a rollout manager packs its shard with this)."""
        return pack_trajectories(trajs, int(self.tokenizer.pad_token_id), self.settings.response_budget)

    def from_packed(self, packed: PackedTrajectories, params: SamplingParams, generate_calls: int, latencies: Sequence[float] = ()) -> Batch:
        """The rollout batch of packed trajectories (in row order), their rewards and agent/* metrics."""
        out = packed_to_batch(packed, params.with_(max_new_tokens=self.settings.response_budget))
        out["agent_reward"] = packed.rewards
        out.meta["metrics"] = metrics_from_totals(packed.totals, generate_calls, latencies)
        return out

    def merge(self, parts: Sequence[tuple[Sequence[int], PackedTrajectories, Any]], params: SamplingParams, generate_calls: int,
              latencies: Sequence[float] = ()) -> Batch:
        """The batch of rollout managers' shards: (the shard's row indices, its pack, a Ray ref to its
        trajectories, fetched only if someone reads `last`)."""
        if self.model_config is not None:  # a pack holds no pixel inputs (the managers run with async rollout, refused for a VLM)
            raise NotImplementedError("rollout managers' packs carry no images: a vision-language policy's trajectories run on the driver")
        self._last, self._last_parts = None, [(rows, ref) for rows, _, ref in parts]
        packed = merge_packed([(rows, p) for rows, p, _ in parts], int(self.tokenizer.pad_token_id))
        return self.from_packed(packed, params, generate_calls, latencies)

    @property
    def last(self) -> list[Trajectory]:
        """The last batch's trajectories in row order (for inspection and tests: on rollout managers they are
        fetched from the managers' object store here, not sent with the batch)."""
        if self._last is None:
            import ray

            trajs: list[Trajectory | None] = [None] * sum(len(rows) for rows, _ in self._last_parts)
            for rows, ref in self._last_parts:
                for j, t in zip(rows, ray.get(ref, timeout=120)):  # a dead manager's raises at once; a stuck store does not hang
                    trajs[j] = t
            self._last = trajs
        return self._last


def agent_rows(prompts: Batch) -> list[dict]:
    """The rows a batch's trajectories start from: raw_prompt (chat messages) and extra_info (tools_kwargs, env, agent_name).
    A VLM's rows (the batch's `multi_modal_data`: each row's images): the prompt's `<image>` placeholders become image parts
    holding those images (`agent/images.py::placeholder_messages`), which the processor tokenises with the tool schemas."""
    from hybridflow.agent.images import placeholder_messages
    from hybridflow.data.vision import RAW_IMAGES_KEY

    images = list(prompts[RAW_IMAGES_KEY]) if RAW_IMAGES_KEY in prompts else [None] * len(prompts)
    return [{"raw_prompt": placeholder_messages(list(prompts["raw_prompt"][i]), images[i]["image"]) if images[i] else list(prompts["raw_prompt"][i]),
             "extra_info": dict(prompts["extra_info"][i] or {})} for i in range(len(prompts))]


def served_model_name(path: str) -> str:
    """The name the agent endpoint serves the policy as: the model directory's name (what /v1/models lists)."""
    return os.path.basename(os.path.normpath(path)) or "policy"
