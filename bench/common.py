"""Shared by the benchmark scripts."""

from __future__ import annotations

import json
import os
import re


def write_rows(path: str, rows: list[dict]) -> None:
    """The benchmark's rows as a JSON list (for plots and for comparing runs)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"rows written to {path}")


def print_rows(title: str, columns: list[tuple[str, str, str]], rows: list[dict], json_path: str | None = None) -> None:
    """The side-by-side table: `columns` are (row key, header, format spec such as ">10.3f"),
    then the rows as JSON when `json_path` is given."""
    print(f"\n{title}")
    # headers take the column's alignment and width (">10.1f" -> ">10")
    print(" ".join(f"{header:{re.match(r'[<>^]?[0-9]*', spec).group()}}" for _, header, spec in columns))
    for r in rows:
        print(" ".join(f"{r[key]:{spec}}" for key, _, spec in columns))
    if json_path:
        write_rows(json_path, rows)


def length_parity_task(root: str) -> tuple[str, str]:
    """(task dir, reward file) under `root`: the digit_max task, and a reward with spread on any model
    (the response's length parity), so every GRPO update moves the weights."""
    from hybridflow.data.tasks import make_max_task

    task = os.path.join(root, "task")
    make_max_task(task)
    reward = os.path.join(root, "length_parity.py")
    with open(reward, "w") as f:
        f.write("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float(len(solution_str) % 2)\n")
    return task, reward
