"""Shared by the benchmark scripts."""

from __future__ import annotations

import json
import os


def write_rows(path: str, rows: list[dict]) -> None:
    """The benchmark's rows as a JSON list (for plots and for comparing runs)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"rows written to {path}")
