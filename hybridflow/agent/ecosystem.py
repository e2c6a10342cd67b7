"""Environments from the ecosystem as `env_agent` environments: OpenEnv (over its client) and
verifiers (its rubric is the reward). Chosen per row like ours (`extra_info.env`), options in
`extra_info.env_kwargs`:

    openenv     {"url": "http://127.0.0.1:8000", "action_key": "text", "message_key": "prompt", "reset_kwargs": {...}}
                An OpenEnv server (a local one, a Docker container, a Space) driven through
                openenv's own `GenericEnvClient` (a WebSocket session per trajectory): reset(**reset_kwargs)
                -> the observation's `message_key` field is the first user message (or the whole
                observation as JSON); each model turn is sent as the action {action_key: text}; the
                step's reward adds to the trajectory's, `done` ends it.
    verifiers   {"taskset": "<id or module>", "index": i}
                A verifiers (v1) taskset's task i: the row's prompt is the task's (`hybridflow
                prepare --verifiers`), the model answers once, and the task's own rubric scores the
                conversation (`Task.score` on a trace of it): its weighted reward is the trajectory's.

Both talk to their package only here; hybridflow's loop sees `areset` / `astep` / `aclose`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from hybridflow.agent.envs import EnvStep, Environment, register_env


# ------------------------------------------------------------------------------------ OpenEnv
@dataclass
class OpenEnvConfig:
    url: str = ""  # the OpenEnv server's base URL (http:// or ws://)
    action_key: str = "text"  # the action field the model's text goes into
    message_key: str | None = None  # the observation field shown to the model (None: the observation as JSON)
    reset_kwargs: dict = field(default_factory=dict)  # passed to the env's reset (e.g. a seed or a target from the row)
    timeout_s: float = 60.0  # one message to the server

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"openenv env: env_kwargs.url must be the server's http(s):// or ws(s):// URL, got {self.url!r}")


@register_env("openenv")
class OpenEnvEnvironment(Environment):
    config_cls = OpenEnvConfig

    def _message(self, observation: Mapping[str, Any]) -> str:
        key = self.config.message_key
        if key is not None:
            if key not in observation:
                raise ValueError(f"openenv env: the observation has no field {key!r} (env_kwargs.message_key); fields: {sorted(observation)}")
            return str(observation[key])
        return json.dumps({k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}, ensure_ascii=False)

    async def areset(self, row: Mapping[str, Any]) -> str:
        from openenv.core import GenericEnvClient

        self.client = GenericEnvClient(base_url=self.config.url, message_timeout_s=self.config.timeout_s)
        result = await self.client.reset(**self.config.reset_kwargs)
        return self._message(result.observation)

    async def astep(self, model_text: str) -> EnvStep:
        result = await self.client.step({self.config.action_key: model_text})
        return EnvStep(self._message(result.observation), float(result.reward or 0.0), bool(result.done))

    async def aclose(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            await client.close()


# ------------------------------------------------------------------------------------ verifiers
@functools.lru_cache(maxsize=16)
def load_taskset(taskset: str) -> list:
    """The tasks of a verifiers (v1) taskset by id (verifiers resolves ids by import: a built-in
    taskset or an installed / importable module exporting one Taskset class)."""
    import verifiers.v1 as vf

    try:
        return list(vf.load_taskset(vf.TasksetConfig(id=taskset)))
    except Exception as e:  # noqa: BLE001 - whatever verifiers raises, name the taskset
        raise ValueError(f"verifiers taskset {taskset!r} does not load: {type(e).__name__}: {e}") from None


def task_prompt(task) -> list[dict]:
    """The chat messages a task asks (its system prompt, then its prompt: a string or messages)."""
    d = task.data
    messages = [{"role": "system", "content": d.system_prompt}] if getattr(d, "system_prompt", None) else []
    prompt = d.prompt
    if isinstance(prompt, str):
        return messages + [{"role": "user", "content": prompt}]
    return messages + [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt or []]


def make_verifiers_rows(taskset: str, size: int | None = None, split: str = "train") -> list[dict]:
    """RL rows of a taskset's first `size` tasks (all when None), for `hybridflow prepare --verifiers`."""
    tasks = load_taskset(taskset)[:size]
    return [{"data_source": "verifiers", "prompt": task_prompt(t), "ability": "agent",
             "reward_model": {"style": "rule", "ground_truth": ""},
             "extra_info": {"split": split, "index": i, "env": "verifiers", "env_kwargs": {"taskset": taskset, "index": i}}}
            for i, t in enumerate(tasks)]


async def score_with_rubric(task, prompt: list[dict], completion: str) -> tuple[float, dict]:
    """(reward, per-function scores and metrics) of the task's rubric on prompt + one assistant reply."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode

    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
    messages = [kinds[m["role"]](content=m["content"]) for m in prompt] + [vf.AssistantMessage(content=completion)]
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig()))
    for i, m in enumerate(messages):
        trace.nodes.append(MessageNode(parent=i - 1 if i else None, message=m, sampled=i == len(messages) - 1))
    await task.score(trace)
    parts = {k: v.score for k, v in (trace.rewards or {}).items() if v is not None}
    parts.update({k: v for k, v in (trace.metrics or {}).items() if v is not None})
    return float(trace.reward or 0.0), parts


@dataclass
class VerifiersConfig:
    taskset: str = ""
    index: int = 0


@register_env("verifiers")
class VerifiersEnvironment(Environment):
    """One answer, scored by the task's rubric (multi-turn verifiers harnesses are not run here)."""

    config_cls = VerifiersConfig

    async def areset(self, row: Mapping[str, Any]) -> str:
        tasks = load_taskset(self.config.taskset)
        if not 0 <= self.config.index < len(tasks):
            raise ValueError(f"verifiers env: index {self.config.index} is outside taskset {self.config.taskset!r} ({len(tasks)} tasks)")
        self.task = tasks[self.config.index]
        self.prompt = [dict(m) for m in row.get("raw_prompt") or []] or task_prompt(self.task)
        return self.prompt[-1]["content"]

    async def astep(self, model_text: str) -> EnvStep:
        reward, self.parts = await score_with_rubric(self.task, self.prompt, model_text)
        return EnvStep("", reward, True)
