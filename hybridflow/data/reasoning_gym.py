"""reasoning-gym tasks as RL data, scored by reasoning-gym's own verifiers (offline: the tasks are generated).

    hybridflow prepare --reasoning-gym chain_sum --size 2000 --seed 1 -o data/rg/train.parquet \
        --rg-config min_terms=2 max_terms=3 max_digits=2
    hybridflow prepare --reasoning-gym chain_sum --size 200 --seed 1000000 -o data/rg/val.parquet ...

Each entry of `reasoning_gym.create_dataset(name, size=, seed=, **config)` becomes a row:

    data_source   "reasoning_gym/<name>"
    prompt        [{"role": "user", "content": question + INSTRUCTION}]
    reward_model  {"style": "rule", "ground_truth": the entry's answer}
    extra_info    {"split", "index", "reasoning_gym": the entry as JSON (question, answer, metadata)}

The reward is `score_answer(answer, entry)` of the task's own dataset class, where `answer` is the
text inside the response's last <answer></answer> (reasoning_gym.utils.extract_answer), stripped;
no tags: 0. Entry i depends on seed + i only, so nearby seeds share entries: keep the train and
validation seeds far apart (the default validation seed is the train seed + 10**6).
"""

from __future__ import annotations

import functools
import json
from typing import Any, Mapping

DATA_SOURCE_PREFIX = "reasoning_gym/"
INSTRUCTION = " Answer in <answer></answer>."


def parse_config(items: list[str] | None) -> dict[str, Any]:
    """["min_terms=2", "operators=['+','-']"] -> {"min_terms": 2, "operators": ["+", "-"]} (values as JSON
    or Python literals, else strings)."""
    import ast

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--rg-config {item!r}: expected key=value")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def make_rows(name: str, size: int, seed: int, config: Mapping[str, Any] | None = None, split: str = "train",
              instruction: str = INSTRUCTION) -> list[dict]:
    """`size` entries of task `name` as RL rows (module docstring)."""
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(name, size=size, seed=seed, **dict(config or {}))
    except (ValueError, TypeError, AssertionError) as e:
        raise ValueError(f"reasoning-gym task {name!r} with {dict(config or {})}: {e}") from None
    rows = []
    for i in range(size):
        e = ds[i]
        entry = {"question": e["question"], "answer": e["answer"], "metadata": e.get("metadata", {})}
        rows.append({"data_source": DATA_SOURCE_PREFIX + name, "prompt": [{"role": "user", "content": e["question"] + instruction}],
                     "ability": "reasoning", "reward_model": {"style": "rule", "ground_truth": str(e["answer"])},
                     "extra_info": {"split": split, "index": i, "reasoning_gym": json.dumps(entry, default=str)}})
    return rows


@functools.lru_cache(maxsize=None)
def _scorer(name: str):
    from reasoning_gym.factory import get_score_answer_fn

    return get_score_answer_fn(name)


def extract(solution_str: str) -> str | None:
    from reasoning_gym.utils import extract_answer

    return extract_answer(solution_str or "", tag_name="answer", strip=True)


def reasoning_gym_score(data_source: str, solution_str: str, extra_info: Mapping[str, Any] | None) -> dict:
    """{"score": the task's own verifier on the extracted answer, "pred": the answer}; a row without its
    entry (extra_info.reasoning_gym) scores 0."""
    name = data_source[len(DATA_SOURCE_PREFIX):]
    raw = (extra_info or {}).get("reasoning_gym")
    answer = extract(solution_str)
    if raw is None or answer is None:
        return {"score": 0.0, "pred": answer}
    entry = json.loads(raw) if isinstance(raw, str) else dict(raw)
    return {"score": float(_scorer(name)(answer, entry)), "pred": answer}
