"""Load a user reward function from a Python file (``custom_reward_function.path`` / ``.name``)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from typing import Callable

from hybridflow.rewards.scorers import compute_score as default_compute_score


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
    mod_name = "hybridflow_custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
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
    return fn
