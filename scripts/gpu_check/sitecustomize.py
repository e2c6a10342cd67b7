"""The GPU image's package set, rehearsed on a CPU machine: with this directory on PYTHONPATH and
HYBRIDFLOW_HIDE_MODULES set (comma-separated top-level module names; `hidden.py` computes them from
image.txt and wheels.txt), those modules are not found -- `import ray` raises ModuleNotFoundError,
`importlib.util.find_spec("ray")` is None and, for HYBRIDFLOW_HIDE_DISTS, `importlib.metadata`
does not list the distribution -- as on a machine where they are not installed. Every finder on
sys.meta_path is wrapped (a finder placed in front that raised would break the availability checks
of libraries that probe with find_spec, as transformers does). Without the variables it does nothing.
scripts/gpu_check.sh --device cpu uses it for every step; tests/test_gpu_check.py to hide Ray."""

import os
import re
import sys

_MODULES = frozenset(n for n in os.environ.get("HYBRIDFLOW_HIDE_MODULES", "").split(",") if n)
_DISTS = frozenset(n for n in os.environ.get("HYBRIDFLOW_HIDE_DISTS", "").split(",") if n)


class _Hiding:
    """A meta-path finder that answers as `inner` does, except for the hidden names."""

    def __init__(self, inner):
        self._inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _MODULES:
            return None
        find = getattr(self._inner, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def find_distributions(self, *args, **kwargs):
        find = getattr(self._inner, "find_distributions", None)
        if find is None:
            return iter(())
        return (d for d in find(*args, **kwargs)
                if re.sub(r"[-_.]+", "-", (d.metadata["Name"] or "")).lower() not in _DISTS)

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


if _MODULES or _DISTS:
    sys.meta_path[:] = [f if isinstance(f, _Hiding) else _Hiding(f) for f in sys.meta_path]
