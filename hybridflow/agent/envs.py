"""Gym-like environments for multi-turn rollouts without tools (the model talks, the env answers).

    env = make_env_for_row(row)          # chosen per row; a fresh, stateful object per trajectory
    first = env.reset(row)               # the env's opening user message
    message, reward, done = env.step(model_text)   # after every assistant turn

The loop appends ``message`` as a ``user`` turn (its token delta, see ``format.message_delta_ids``)
until ``done``. For a vision-language policy ``message`` may also be a list of content parts, text and
images (``{"type": "image", "image": <PIL image or bytes>}``: `agent/images.py`). Rewards from
``step`` are per turn; the loop decides how they reach the trajectory (e.g. summed into the final score).

Row selection: ``extra_info.env`` names the environment (ours), or verl's interaction field
``extra_info.interaction_kwargs.name``; per-env options come from ``extra_info.env_kwargs`` (or
the rest of ``interaction_kwargs``) on top of the config's. Simplified against verl's
``BaseInteraction``: synchronous (an env is pure Python and fast; a slow one can be wrapped in
``asyncio.to_thread`` by the loop) and one object per trajectory instead of instance ids.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

from hybridflow.agent.registry import class_registry

__all__ = [
    "EnvStep",
    "Environment",
    "GuessNumberEnv",
    "env_name_for_row",
    "make_env",
    "make_env_for_row",
    "register_env",
]


class EnvStep(NamedTuple):
    """One environment reply; unpacks as ``message, reward, done``."""

    message: str
    reward: float
    done: bool


class Environment:
    """Base class. ``config_cls`` (a dataclass) types the options; unknown keys fail loudly."""

    name: str = ""
    config_cls: type | None = None

    def __init__(self, config: Mapping[str, Any] | None = None):
        raw = dict(config or {})
        if self.config_cls is None:
            self.config = raw
        else:
            known = {f.name for f in dataclasses.fields(self.config_cls)}
            unknown = sorted(set(raw) - known)
            if unknown:
                raise ValueError(f"env {self.name!r}: unknown option(s) {unknown}; known: {sorted(known)}")
            self.config = self.config_cls(**raw)

    def reset(self, row: Mapping[str, Any]) -> str:
        raise NotImplementedError

    def step(self, model_text: str) -> EnvStep:
        raise NotImplementedError

    # The loop awaits these; an environment that talks to a server (ecosystem.py) overrides them, a
    # pure-Python one keeps reset / step.
    async def areset(self, row: Mapping[str, Any]) -> str:
        return self.reset(row)

    async def astep(self, model_text: str) -> EnvStep:
        return self.step(model_text)

    async def aclose(self) -> None:
        """Release what the episode holds (a connection); called once when the trajectory ends."""


_ENVS: dict[str, type[Environment]] = {}


register_env = class_registry("environment", _ENVS, set_name=True)
# Environments defined in modules that import this one, imported on first use: name -> module.
BUILT_IN_ENVS = {"openenv": "hybridflow.agent.ecosystem", "verifiers": "hybridflow.agent.ecosystem"}


def make_env(name: str, config: Mapping[str, Any] | None = None) -> Environment:
    if name not in _ENVS and name in BUILT_IN_ENVS:
        importlib.import_module(BUILT_IN_ENVS[name])
    if name not in _ENVS:
        raise ValueError(f"unknown environment {name!r}; registered: {sorted(set(_ENVS) | set(BUILT_IN_ENVS))}")
    return _ENVS[name](config)


def _extra(row: Mapping[str, Any]) -> dict:
    return dict(row.get("extra_info") or {})


def env_name_for_row(row: Mapping[str, Any], default: str | None = None) -> str | None:
    """The env a row asks for: ``extra_info.env``, else ``extra_info.interaction_kwargs.name``, else ``default``."""
    extra = _extra(row)
    name = extra.get("env") or (extra.get("interaction_kwargs") or {}).get("name")
    return name or default


def make_env_for_row(row: Mapping[str, Any], default: str | None = None, config: Mapping[str, Any] | None = None) -> Environment | None:
    """A fresh env for one trajectory of ``row`` (None when the row asks for none and there is no default).

    Options: ``config`` (e.g. from the run config) overlaid by the row's ``extra_info.env_kwargs``.
    """
    name = env_name_for_row(row, default)
    if name is None:
        return None
    # None values are dropped: a parquet file of rows with different env_kwargs gives every row every key (None where it had none)
    row_kwargs = {k: v for k, v in dict(_extra(row).get("env_kwargs") or {}).items() if v is not None}
    return make_env(name, {**dict(config or {}), **row_kwargs})


# ------------------------------------------------------------------------------------ guess
@dataclass
class GuessNumberConfig:
    lo: int = 1
    hi: int = 100
    max_turns: int = 8
    # Reward on a correct guess = max(0, 1 - turn_penalty * (turns used - 1)): 0.0 keeps the plain
    # 1.0 for any correct answer; e.g. 0.1 pays 1.0 for a first-turn hit and 0.3 for the 8th, which
    # rewards bisecting instead of guessing along.
    turn_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.lo > self.hi:
            raise ValueError(f"guess env: lo={self.lo} > hi={self.hi}")
        if self.max_turns < 1:
            raise ValueError(f"guess env: max_turns must be >= 1, got {self.max_turns}")


_INT = re.compile(r"-?\d+")


@register_env("guess")
class GuessNumberEnv(Environment):
    """Guess a hidden integer; the env answers "higher", "lower" or "correct".

    The target is ``extra_info.target`` of the row (so data, not a seed, decides it and a
    validation set is fixed); ``extra_info.lo`` / ``hi`` / ``max_turns`` override the config.
    The model's answer is the *last* integer in its text (models think aloud before answering).
    Every reply counts as a turn, an unparseable or out-of-range one too, so a trajectory always
    ends within ``max_turns``. Reward: see ``GuessNumberConfig.turn_penalty``; 0 when it fails.
    """

    config_cls = GuessNumberConfig

    def reset(self, row: Mapping[str, Any]) -> str:
        extra = _extra(row)
        cfg = self.config
        self.lo = int(extra.get("lo", cfg.lo))
        self.hi = int(extra.get("hi", cfg.hi))
        self.max_turns = int(extra.get("max_turns", cfg.max_turns))
        if "target" not in extra:
            raise ValueError(f"guess env: the row has no extra_info.target (extra_info keys: {sorted(extra)})")
        self.target = int(extra["target"])
        if not self.lo <= self.target <= self.hi:
            raise ValueError(f"guess env: extra_info.target={self.target} is outside {self.lo}..{self.hi}")
        self.turns = 0
        self.done = False
        return (f"I am thinking of an integer between {self.lo} and {self.hi}. Guess it: reply with one number. "
                f"I will say higher, lower or correct. You have {self.max_turns} guesses.")

    def step(self, model_text: str) -> EnvStep:
        if getattr(self, "done", True):
            raise RuntimeError("guess env: step() after the episode ended (call reset(row) first)")
        self.turns += 1
        left = self.max_turns - self.turns
        numbers = _INT.findall(model_text or "")
        guess = int(numbers[-1]) if numbers else None
        if guess == self.target:
            self.done = True
            reward = max(0.0, 1.0 - self.config.turn_penalty * (self.turns - 1))
            return EnvStep(f"correct! The number is {self.target}.", reward, True)
        if left <= 0:
            self.done = True
            return EnvStep(f"Out of guesses: the number was {self.target}.", 0.0, True)
        if guess is None:
            msg = f"I could not find a number in your answer. Reply with one integer between {self.lo} and {self.hi}."
        elif not self.lo <= guess <= self.hi:
            msg = f"{guess} is outside {self.lo}..{self.hi}. Guess again."
        else:
            msg = "higher" if guess < self.target else "lower"
        return EnvStep(f"{msg} ({left} guess{'es' if left != 1 else ''} left)", 0.0, False)
