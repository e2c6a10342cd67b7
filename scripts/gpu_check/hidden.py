"""The installed modules the GPU image would lack: every distribution of this Python that is neither
in image.txt (what the image has), nor required by one of those as installed here (their declared
dependencies, followed through), nor in wheels.txt (what scripts/gpu_wheels.sh carries), and the
top-level modules it provides that no allowed distribution provides too.

    python scripts/gpu_check/hidden.py modules   # comma-separated module names (HYBRIDFLOW_HIDE_MODULES)
    python scripts/gpu_check/hidden.py dists     # comma-separated distribution names (HYBRIDFLOW_HIDE_DISTS)
"""

from __future__ import annotations

import fnmatch
import importlib.metadata as md
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(path: pathlib.Path) -> list[str]:
    """A list file's names (one a line; `#` comments, `name==version` pins)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(norm(re.split(r"[=<>!~\[ ;]", line, maxsplit=1)[0]))
    return out


def top_levels(dist: md.Distribution) -> set[str]:
    text = dist.read_text("top_level.txt")
    if text:
        return {n.strip() for n in text.split() if n.strip()}
    out = set()
    for f in dist.files or []:
        parts = f.parts
        if not parts or parts[0] in ("..", "__pycache__") or parts[0].endswith((".dist-info", ".data", ".egg-info")):
            continue
        name = parts[0]
        if len(parts) == 1:
            if name.endswith(".py"):
                name = name[:-3]
            elif name.endswith(".so"):
                name = name.split(".")[0]
            else:
                continue  # .pth files and the like
        out.add(name)
    return out


def closure(roots: list[str], installed: dict[str, md.Distribution]) -> set[str]:
    """`roots` and what they require, unconditionally, as installed here (names normalized)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [n for n in roots if n in installed]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in installed[name].requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if norm(req.name) in installed:
                todo.append(norm(req.name))
    return seen


def main() -> None:
    installed = {norm(d.metadata["Name"] or ""): d for d in md.distributions()}
    image = listed(HERE / "image.txt")
    patterns = image + sorted(closure([n for n in installed for p in image if fnmatch.fnmatch(n, p)], installed))
    patterns += listed(HERE / "wheels.txt") + ["hybridflow"]
    hidden_mods: set[str] = set()
    kept_mods: set[str] = set()
    hidden_dists: set[str] = set()
    for name, dist in installed.items():
        if not name:
            continue
        if any(fnmatch.fnmatch(name, p) for p in patterns):
            kept_mods |= top_levels(dist)
        else:
            hidden_dists.add(name)
            hidden_mods |= top_levels(dist)
    hidden_mods -= kept_mods | set(sys.stdlib_module_names) | {"sitecustomize"}
    print(",".join(sorted(hidden_mods if sys.argv[1:] == ["modules"] else hidden_dists)))


if __name__ == "__main__":
    main()
