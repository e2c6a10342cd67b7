"""Imports run one way (docs/architecture.md, "Layers and imports"): read from the source, not run.

Every module under hybridflow/ is parsed (ast); each `import` / `from ... import` of a hybridflow
module is an edge, with where it sits: at module level (runs when the module is imported; an
`if TYPE_CHECKING:` block never runs) or inside a function (runs when that is called). Importing
`a.b.c` first runs the packages `a` and `a.b` (their __init__), so those count as edges too.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "hybridflow"


class Edge(NamedTuple):
    source: str
    target: str
    line: int
    module_level: bool


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _known(name: str) -> str:
    """The module `name` runs: itself, or (a name imported from a module) its longest known prefix."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [_known(a.name) for a in node.names if a.name.split(".")[0] == "hybridflow"]
    base = node.module or ""
    if node.level:  # relative: from the module's package
        package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        base = f"{package}.{base}" if base else package
    if base.split(".")[0] != "hybridflow":
        return []
    return [_known(f"{base}.{a.name}") if f"{base}.{a.name}" in MODULES else _known(base) for a in node.names]


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def edges_of(module: str) -> list[Edge]:
    out: list[Edge] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), module_level)
            else:
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    out.extend(Edge(module, t, child.lineno, module_level) for t in _targets(module, child) if t != module)
                visit(child, module_level)

    visit(ast.parse(MODULES[module].read_text(), str(MODULES[module])), True)
    return out


EDGES = {m: edges_of(m) for m in MODULES}


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _graph(module_level_only: bool, within: str = "hybridflow") -> dict[str, dict[str, Edge]]:
    """module -> {module it runs: the import that runs it}; a target's packages run first (counted),
    the importer's own packages already ran (not counted)."""
    graph: dict[str, dict[str, Edge]] = {m: {} for m in MODULES if m == within or m.startswith(within + ".")}
    for m in graph:
        for e in EDGES[m]:
            if module_level_only and not e.module_level:
                continue
            for t in [*_ancestors(e.target), e.target]:
                if t in graph and t != m and t not in _ancestors(m):
                    graph[m].setdefault(t, e)
    return graph


def _cycles(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strongconnect(v)
    return out


def _describe(graph: dict[str, dict[str, Edge]], comp: list[str]) -> str:
    lines = [f"{e.source}:{e.line} imports {e.target}" for m in comp for t, e in graph[m].items() if t in comp]
    return "cycle " + " <-> ".join(comp) + ":\n    " + "\n    ".join(lines)


def test_the_parser_sees_the_imports():
    """The walk finds what it should (a check on the checker): a module-level edge, a function-level
    one, and a `from package import submodule` resolved to the submodule."""
    assert len(MODULES) > 50 and "hybridflow.config" in MODULES and "hybridflow.config.validate" in MODULES
    loader = {e.target: e for e in EDGES["hybridflow.config.loader"]}
    assert loader["hybridflow.config.schema"].module_level
    cli = EDGES["hybridflow.cli"]
    assert cli and not all(e.module_level for e in cli)  # the CLI imports its commands lazily
    assert _known("hybridflow.hybrid_engine.plan.ReshardPlan") == "hybridflow.hybrid_engine.plan"


def test_no_import_cycle_at_module_level():
    """(a) Importing any hybridflow module never re-enters a module that is still loading."""
    graph = _graph(module_level_only=True)
    cycles = _cycles(graph)
    assert not cycles, "\n".join(_describe(graph, c) for c in cycles)


def _bottom(module: str) -> bool:
    return module == "hybridflow.protocol" or module == "hybridflow.config" or module.startswith("hybridflow.config.")


def test_config_and_protocol_import_nothing_above_them():
    """(b) The bottom layer (hybridflow.config.*, hybridflow.protocol) imports only itself -- at module
    level and inside functions. Checks that need a component's knowledge are registered by that
    component; the validator reaches them only by importing the modules named in ONE tuple,
    `validate.CHECK_MODULES` (a runtime dependency by name, not an import statement)."""
    bad = [f"{e.source}:{e.line} imports {e.target}{'' if e.module_level else ' (inside a function)'}"
           for m in MODULES if _bottom(m) for e in EDGES[m] if not _bottom(e.target)]
    assert not bad, "the bottom layer imports upward:\n  " + "\n  ".join(bad)
    # importlib / __import__ by name: only the registry loop over CHECK_MODULES in validate.py
    dynamic = []
    for m in MODULES:
        if not _bottom(m):
            continue
        tree = ast.parse(MODULES[m].read_text())
        loops = {id(n.iter): n for n in ast.walk(tree) if isinstance(n, ast.For)}
        registry_loops = [n for n in loops.values() if ast.unparse(n.iter) == "CHECK_MODULES"]
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            name = ast.unparse(call.func)
            if name.endswith("import_module") or name == "__import__":
                arg = call.args[0] if call.args else None
                in_loop = any(isinstance(arg, ast.Name) and isinstance(loop.target, ast.Name) and loop.target.id == arg.id
                              and any(c is call for c in ast.walk(loop)) for loop in registry_loops)
                if not (m == "hybridflow.config.validate" and in_loop):
                    dynamic.append(f"{m}:{call.lineno} {ast.unparse(call)}")
    assert not dynamic, "imports by name outside validate.CHECK_MODULES:\n  " + "\n  ".join(dynamic)


def test_config_has_no_import_cycle_even_inside_functions():
    """The loader and the verl-key translator share a bottom module instead of importing each other."""
    graph = _graph(module_level_only=False, within="hybridflow.config")
    cycles = _cycles(graph)
    assert not cycles, "\n".join(_describe(graph, c) for c in cycles)


def test_no_import_cycle_anywhere_even_inside_functions():
    """No circle in the house: e.g. rollout/ and hybrid_engine/ meet in protocol.py (WeightPiece,
    GenLayout) and the rollout registry finds the built-in backends by import path, so
    rollout/base.py never imports a backend that imports it back."""
    graph = _graph(module_level_only=False)
    cycles = _cycles(graph)
    assert not cycles, "\n".join(_describe(graph, c) for c in cycles)


def test_lower_layers_do_not_import_upward():
    """data and parallel sit below the engine, the rollout, the workers, the controller and the
    trainer (inside functions too): the training layout lives in hybridflow.parallel.dims, the prompt
    loader in hybridflow.data."""
    above = {
        "hybridflow.data": ("hybridflow.parallel", "hybridflow.hybrid_engine", "hybridflow.rollout", "hybridflow.workers",
                            "hybridflow.controller", "hybridflow.trainer", "hybridflow.cli"),
        "hybridflow.parallel": ("hybridflow.hybrid_engine", "hybridflow.rollout", "hybridflow.workers", "hybridflow.controller",
                                "hybridflow.trainer", "hybridflow.cli", "hybridflow.planning"),
    }
    bad = []
    for layer, forbidden in above.items():
        for m in MODULES:
            if m == layer or m.startswith(layer + "."):
                bad += [f"{e.source}:{e.line} imports {e.target}" for e in EDGES[m]
                        if any(e.target == f or e.target.startswith(f + ".") for f in forbidden)]
    assert not bad, "upward imports:\n  " + "\n  ".join(bad)


def test_importing_the_config_stays_light():
    """`import hybridflow.config` (schema, loader, validator) loads no torch and nothing above config."""
    code = ("import sys, hybridflow.config, hybridflow.config.parallel, hybridflow.config.verl_compat; "
            "print('\\n'.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    heavy = [m for m in loaded if m == "torch" or m.startswith("torch.") or m.startswith("ray")
             or (m.startswith("hybridflow.") and not _bottom(m))]
    assert not heavy, f"import hybridflow.config loaded {heavy}"


# The layers, bottom first (docs/architecture.md, "Layers and imports"): a module imports only from
# its own layer or below, at module level and inside functions. A module is in the layer of its
# longest listed prefix.
LAYERS: list[tuple[str, ...]] = [
    ("hybridflow.protocol", "hybridflow.config", "hybridflow.data"),
    ("hybridflow.parallel", "hybridflow.models", "hybridflow.utils.checkpoint", "hybridflow.utils.export", "hybridflow.utils.memory",
     "hybridflow.run_plan"),
    ("hybridflow.hybrid_engine", "hybridflow.rollout", "hybridflow.algorithms", "hybridflow.planning", "hybridflow.rewards",
     "hybridflow.agent", "hybridflow.profiler"),
    ("hybridflow.engine",),
    ("hybridflow.controller",),
    ("hybridflow.workers",),
    # the rollout service beside the trainer (it uses the trainer's batch keys; the trainer reaches it through RolloutService)
    ("hybridflow.trainer", "hybridflow.service", "hybridflow.demo", "hybridflow.utils"),  # utils.distributed / hf_integration: users' own loops
    ("hybridflow", "hybridflow.cli", "hybridflow.trainer.main_ppo"),  # verl's entry point name is a command line
]


def layer_of(module: str) -> int:
    found = [(len(name), i) for i, names in enumerate(LAYERS) for name in names if module == name or module.startswith(name + ".")]
    assert found, f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)"
    return max(found)[1]


def test_every_import_goes_down_the_layers():
    """(c) No edge from a module to a higher layer, at module level or inside a function: the
    engine imports no worker, the rollout no engine, parallel no algorithm (the pipeline's head is
    passed in), config and data nothing above them."""
    assert layer_of("hybridflow.engine.train_engine") > layer_of("hybridflow.rollout.base") > layer_of("hybridflow.parallel.pipeline")
    up = [f"{e.source}:{e.line} imports {e.target}{'' if e.module_level else ' (inside a function)'}"
          for m in MODULES for e in EDGES[m] if e.target != "hybridflow" and layer_of(e.target) > layer_of(e.source)]
    assert not up, "upward imports:\n  " + "\n  ".join(up)


def test_no_worker_loops_over_mini_batches():
    """The update loop (epochs x mini-batches x micro-batches, steps, metric means) lives once, in
    `TrainEngine.train`; a worker's update endpoint builds its objective and calls it. Any `for`
    (or comprehension) in hybridflow.workers over a batch split, micro-batches or epochs fails."""
    def loops(tree: ast.AST):
        for node in ast.walk(tree):
            if isinstance(node, (ast.For, ast.comprehension)):
                yield node.iter

    bad = []
    for m, path in MODULES.items():
        if m.startswith("hybridflow.workers"):
            for it in loops(ast.parse(path.read_text())):
                text = ast.unparse(it)
                if ".split(" in text and "role" not in text or "micro_batches" in text or "epochs" in text:
                    bad.append(f"{m}:{it.lineno} for ... in {text}")
    assert not bad, "mini-batch loops in workers (use TrainEngine.train):\n  " + "\n  ".join(bad)
    # the check sees such a loop (a check on the checker)
    sample = ast.parse("for _ in range(cfg.ppo_epochs):\n    for mini in data.split(rows):\n        pass")
    assert [ast.unparse(i) for i in loops(sample)] == ["range(cfg.ppo_epochs)", "data.split(rows)"]


ROLE_SECTIONS = ("actor_rollout_ref", "critic")


def role_section_reads(tree: ast.AST) -> list[ast.Attribute]:
    """`<x>.actor_rollout_ref` anywhere, and `<x>.critic` where <x> is a config (`cfg`, `config`,
    `self.cfg`, ...): the root config's role sections read directly."""
    def is_config(node: ast.expr) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name in ("cfg", "config", "root")

    found = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and (n.attr == "actor_rollout_ref" or (n.attr == "critic" and is_config(n.value)))]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def test_only_config_and_the_run_plan_read_the_role_sections():
    """Each role gets only its spec: `run_plan.resolve(cfg)` is the one reader of cfg.actor_rollout_ref
    and cfg.critic outside hybridflow.config (the validator, derived defaults); workers, engines,
    rollout backends and the driver read the specs it returns."""
    bad = [f"{m}:{n.lineno} {ast.unparse(n)}" for m, path in MODULES.items()
           if not (m.startswith("hybridflow.config") or m == "hybridflow.run_plan")
           for n in role_section_reads(ast.parse(path.read_text()))]
    assert not bad, "reads of the root config's role sections (use the role's spec, hybridflow/run_plan.py):\n  " + "\n  ".join(bad)
    sample = ast.parse("n = self.cfg.actor_rollout_ref.rollout.n\nv = self.critic.update_critic(b)\nc = cfg.critic.ppo_epochs")
    assert [ast.unparse(n) for n in role_section_reads(sample)] == ["self.cfg.actor_rollout_ref", "cfg.critic"]
