"""Rule-based scorers and the default ``compute_score`` dispatcher (verl-compatible signature)."""

from __future__ import annotations

import re
from typing import Any

_INT_RE = re.compile(r"-?\d+")
_GSM8K_RE = re.compile(r"#### *\$?\s*(-?[0-9][0-9.,$]*)")


def _to_number(text: Any):
    s = str(text).strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return int(s)
    except ValueError:
        try:
            return float(s)
        except ValueError:
            return None


def _same_answer(pred: str, ground_truth: Any) -> bool:
    a, b = _to_number(pred), _to_number(ground_truth)
    if a is not None and b is not None:
        return a == b
    return str(pred).strip() == str(ground_truth).strip()


def exact_answer_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 if the LAST integer in ``solution_str`` equals ``ground_truth``, else 0.0."""
    found = _INT_RE.findall(solution_str or "")
    if not found:
        return 0.0
    return 1.0 if _same_answer(found[-1], ground_truth) else 0.0


def extract_gsm8k_answer(solution_str: str):
    """The number after the LAST ``####`` marker (commas and ``$`` stripped), or None."""
    found = _GSM8K_RE.findall(solution_str or "")
    if not found:
        return None
    ans = found[-1].replace(",", "").replace("$", "").rstrip(".")
    return ans or None


def gsm8k_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> float:
    """GSM8K strict format: ``#### <number>``; ``score`` if it equals the ground truth, else ``format_score``
    when a number was found, 0.0 when none was."""
    ans = extract_gsm8k_answer(solution_str)
    if ans is None:
        return 0.0
    return score if _same_answer(ans, ground_truth) else format_score


_EXACT_ANSWER = ("arith_add", "arithmetic", "digit_max", "multiply")
_GSM8K = ("openai/gsm8k", "gsm8k")
# MATH-style rows (a \boxed{} answer compared as math: hybridflow/rewards/math.py), by verl's names.
_MATH = ("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math_dapo", "aime", "aime2024", "aime2025")
_CODE = ("code",)
_VISION = ("vision_colour",)  # the synthetic visual task (data/vision_task.py): the last word names the colour
# Rows played against an environment (hybridflow/agent/envs.py, ecosystem.py) or by a black-box agent that scores its own
# episode (agent/openai_agent.py): that reward is the trajectory's (`agent_reward`, added by the trainer); the rule adds nothing.
_ENVIRONMENT = ("guess", "agent", "verifiers", "openenv")


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  code_strict: bool = False) -> float | dict:
    """Default reward dispatcher by ``data_source``. Sources with an answer return
    ``{"score": ..., "pred": <the extracted answer>}`` (validation's maj@N votes on ``pred``).
    ``code_strict`` (custom_reward_function.code_strict): code checks that cannot be graded out of
    the solution's process fail instead of being graded in it (rewards/code.py)."""
    if data_source in _EXACT_ANSWER:
        found = _INT_RE.findall(solution_str or "")
        return {"score": exact_answer_score(solution_str, ground_truth), "pred": found[-1] if found else None}
    if data_source in _GSM8K:
        return {"score": gsm8k_score(solution_str, ground_truth), "pred": extract_gsm8k_answer(solution_str)}
    if data_source in _MATH:
        from hybridflow.rewards.math import math_score

        return math_score(solution_str, ground_truth)
    if data_source in _ENVIRONMENT:
        return 0.0
    if data_source in _VISION:
        from hybridflow.rewards.vision import colour_score

        return colour_score(solution_str, ground_truth)
    if data_source in _CODE:
        from hybridflow.rewards.code import code_reward  # lazy: only code rewards need the sandbox

        return code_reward(solution_str, ground_truth, strict=code_strict)
    if data_source.startswith("reasoning_gym/"):  # hybridflow prepare --reasoning-gym: the task's own verifier
        from hybridflow.data.reasoning_gym import reasoning_gym_score

        return reasoning_gym_score(data_source, solution_str, extra_info)
    raise NotImplementedError(
        f"no built-in reward for data_source {data_source!r} (built-in: {', '.join(_EXACT_ANSWER + _GSM8K + _MATH + _CODE + _ENVIRONMENT + _VISION)}, "
        f"reasoning_gym/<task>); "
        f"set custom_reward_function.path (and custom_reward_function.name) to a file defining "
        f"compute_score(data_source, solution_str, ground_truth, extra_info)"
    )
