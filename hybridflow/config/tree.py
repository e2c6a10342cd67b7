"""The bottom of the config package: its error type and the two dict-tree helpers that both the
loader and the verl-key translator (`verl_compat.py`) use, so neither imports the other."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config problem the user can fix; the message names the key and what to change."""


def dotted_tree(key: str, value: Any) -> dict:
    """"a.b.c", v -> {"a": {"b": {"c": v}}}."""
    tree: dict = {}
    node = tree
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return tree


def merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, recursively for mappings (neither is modified)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out
