"""No config key that silently does nothing.

Every leaf field of the three config schemas (RL, SFT, reward-model training) must be read by code
that acts on it: anything under hybridflow/ but the schema, the loader, verl's compatibility table
and the validator (a key that is only validated does nothing). A verl key hybridflow does not
implement belongs in config/verl_compat.py, which refuses it with the reason, not in the schema.

"Read" is found statically, by the section a field belongs to: an attribute ``x.<field>`` counts
when ``x`` is that section (``....rollout.temperature``), a name bound to it (``r = cfg.rollout``,
``s = r.val_kwargs if greedy else r``, a parameter annotated with the section's class, or a
parameter that a call passes the section to), or ``self`` inside the section's own methods
(``rs_bounds``). A field that no such read names is reported, with its dotted key. The scan knows
nothing of which values a key takes: ``test_..._values_take_effect`` tests elsewhere do that.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import typing

from hybridflow.config.schema import HybridFlowConfig, RewardTrainConfig, SFTConfig

PKG = pathlib.Path(__file__).resolve().parent.parent / "hybridflow"
NOT_ACTING = {"config/schema.py", "config/loader.py", "config/verl_compat.py", "config/validate.py"}
ROOTS = (HybridFlowConfig, SFTConfig, RewardTrainConfig)


def leaf_fields(root: type) -> list[tuple[str, str, str]]:
    """(dotted key, the name of the section it is in, field name) for every non-dataclass field."""
    out = []

    def walk(cls: type, prefix: str, section: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.", f.name)
            else:
                out.append((prefix + f.name, section, f.name))

    walk(root, "", "<root>")
    return out


def sections_by_class() -> dict[str, set[str]]:
    """Config class name -> the names of the fields holding it (``OptimConfig`` -> {"optim"})."""
    out: dict[str, set[str]] = {}

    def walk(cls: type, name: str) -> None:
        out.setdefault(cls.__name__, set()).add(name)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f.name)

    for root in ROOTS:
        walk(root, "<root>")
    return out


def _annotation_names(ann: ast.expr | None) -> list[str]:
    if ann is None:
        return []
    text = ann.value if isinstance(ann, ast.Constant) and isinstance(ann.value, str) else ast.unparse(ann)
    return [w.strip() for w in text.replace("Optional[", "").replace("]", "").split("|")]


def reads() -> set[tuple[str, str]]:
    """(section, field) pairs that acting code reads."""
    classes = sections_by_class()
    files = [(p.relative_to(PKG).as_posix(), ast.parse(p.read_text())) for p in sorted(PKG.rglob("*.py"))]
    params: dict[str, list[list[str]]] = {}  # function name -> its definitions' positional parameters
    for _, tree in files:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params.setdefault(node.name, []).append([a.arg for a in node.args.args])
    found = {(sec, name) for sec, name in _self_reads(files, classes)}
    passed: dict[str, set[str]] = {}  # parameter name -> the sections call sites pass to it (calls cross files)
    for _ in range(2):  # a parameter passed on to another function
        for _, tree in files:
            for k, v in _bind(tree, classes, params, passed)[1].items():
                passed.setdefault(k, set()).update(v)
    for rel, tree in files:
        if rel not in NOT_ACTING:
            alias = _bind(tree, classes, params, passed)[0]
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    found.update((sec, node.attr) for sec in _names_of(node.value, alias))
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                        and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                    found.update((sec, node.args[1].value) for sec in _names_of(node.args[0], alias))
    return found


def _names_of(v: ast.expr, alias: dict[str, set[str]]) -> set[str]:
    """The section names an expression may stand for: its own last name and what that name is bound to."""
    if isinstance(v, ast.Attribute):
        return {v.attr} | alias.get(v.attr, set())
    if isinstance(v, ast.Name):
        return {v.id} | alias.get(v.id, set())
    if isinstance(v, ast.IfExp):
        return _names_of(v.body, alias) | _names_of(v.orelse, alias)
    return set()


def _bind(tree: ast.AST, classes: dict[str, set[str]], params: dict[str, list[list[str]]],
          passed: dict[str, set[str]]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(name -> sections it is bound to in this file, parameter -> sections this file's calls pass it)."""
    alias = {k: set(v) for k, v in passed.items()}
    calls: dict[str, set[str]] = {}
    renamed = {a.asname: a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names if a.asname}
    for _ in range(3):  # aliases of aliases (r = cfg.rollout; s = r.val_kwargs if greedy else r)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.args + node.args.kwonlyargs:
                    for cls in _annotation_names(a.annotation):
                        alias.setdefault(a.arg, set()).update(classes.get(cls, ()))
            elif isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets if not isinstance(t, ast.Tuple)]
                pairs += [pair for t in node.targets if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple)
                          for pair in zip(t.elts, node.value.elts)]
                for t, v in pairs:
                    key = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
                    if key:
                        alias.setdefault(key, set()).update(_names_of(v, alias))
            elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                fname = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                for names in params.get(renamed.get(fname, fname), []):
                    for pname, arg in zip(names, node.args):
                        calls.setdefault(pname, set()).update(_names_of(arg, alias))
                        alias.setdefault(pname, set()).update(_names_of(arg, alias))
    return alias, calls


def _self_reads(files: list[tuple[str, ast.AST]], classes: dict[str, set[str]]) -> set[tuple[str, str]]:
    """A section's own methods in the schema (``rs_bounds``) read its fields through ``self``."""
    out = set()
    for rel, tree in files:
        if rel != "config/schema.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in classes:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name != "__post_init__":
                        out.update((sec, sub.attr) for sub in ast.walk(item) for sec in classes[node.name]
                                   if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self")
    return out


def unread_keys(roots: tuple[type, ...] = ROOTS) -> list[str]:
    found = reads()
    out = []
    for root in roots:
        for key, section, name in leaf_fields(root):
            sections = {section} if section != "<root>" else {"cfg", "config", "self"}
            if not any((s, name) in found for s in sections):
                out.append(f"{root.__name__}: {key}")
    return out


def test_every_config_key_is_read():
    dead = unread_keys()
    assert not dead, ("config keys that nothing outside validation reads (wire them, or move them to "
                      "config/verl_compat.py with the reason they are refused):\n  " + "\n  ".join(dead))


@dataclasses.dataclass
class _ProbeSection:
    enable: bool = False  # a real filter_groups field: read by the trainer
    max_num_gen_batches: int = 10  # likewise
    never_read_anywhere: int = 0  # a dead key


@dataclasses.dataclass
class _ProbeRoot:
    filter_groups: _ProbeSection = dataclasses.field(default_factory=_ProbeSection)


def test_the_scan_sees_a_dead_key():
    """The oracle can fail: a field that nothing reads is reported by its key; its live neighbours are not."""
    assert unread_keys((_ProbeRoot,)) == ["_ProbeRoot: filter_groups.never_read_anywhere"]
