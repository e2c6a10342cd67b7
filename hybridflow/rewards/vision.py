"""Exact-answer reward of the ``vision_colour`` task (`data/vision_task.py`): the LAST word of the response,
lower-cased, must be the ground-truth colour ("The circle is blue." -> "blue")."""

from __future__ import annotations

import re
from typing import Any

_WORD_RE = re.compile(r"[A-Za-z]+")


def last_word(solution_str: str) -> str | None:
    found = _WORD_RE.findall(solution_str or "")
    return found[-1].lower() if found else None


def colour_score(solution_str: str, ground_truth: Any) -> dict:
    """``{"score": 1.0 if the last word is the ground truth else 0.0, "pred": that word}``."""
    pred = last_word(solution_str)
    return {"score": 1.0 if pred is not None and pred == str(ground_truth).strip().lower() else 0.0, "pred": pred}
