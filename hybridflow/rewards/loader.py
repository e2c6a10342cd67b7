"""Load a user reward function from a Python file (``custom_reward_function.path`` / ``.name``)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from typing import Callable

from hybridflow.rewards.scorers import compute_score as default_compute_score


CUSTOM_MODULE_PREFIX = "hybridflow_custom_reward_"  # the module a file is loaded as: importable in this process only
_ORIGINS: dict[int, tuple[str, str, Callable]] = {}  # id(fn) -> (path, name, fn): what a reward worker loads it from


def origin_of(fn: Callable) -> tuple[str, str] | None:
    """(path, name) of a function this process loaded with :func:`load_custom_reward_fn`, else None.
    A reward worker (``workers.py``) loads it again from there: its module cannot be imported by name elsewhere."""
    found = _ORIGINS.get(id(fn))
    return (found[0], found[1]) if found is not None and found[2] is fn else None


class RewardFunctionError(ValueError):
    """The custom reward function cannot be loaded."""


def load_custom_reward_fn(path: str | None, name: str = "compute_score") -> Callable:
    """Return ``name`` from the Python file at ``path``; ``path=None`` -> the default dispatcher."""
    if path is None or str(path) == "":
        return default_compute_score
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(path):
        raise RewardFunctionError(f"custom_reward_function.path: file not found: {path}")
    name = name or "compute_score"
    mod_name = CUSTOM_MODULE_PREFIX + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise RewardFunctionError(f"custom_reward_function.path: cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # so pickling (Ray) can find functions defined there
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise RewardFunctionError(
            f"custom_reward_function.path: importing {path} failed: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardFunctionError(
            f"custom_reward_function.name: function {name!r} not found in {path} "
            f"(custom_reward_function.path)"
        )
    if not callable(fn):
        raise RewardFunctionError(f"custom_reward_function.name: {name!r} in {path} is not callable")
    _ORIGINS[id(fn)] = (path, name, fn)
    return fn
