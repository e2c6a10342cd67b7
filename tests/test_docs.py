"""The docs a newcomer follows literally, checked against the code (fast tier: no Ray, no worker).

From README.md and docs/*.md this reads every fenced block and every inline code span and checks:
- every `hybridflow ...` command: the subcommand and its flags parse with the real parsers, and the
  config commands (train, dpo, sft, rm, demo) load their config + `key=value` overrides and pass the
  same checks a run makes before Ray starts (validation, derived sizes, the memory pre-flight), in a
  directory holding what the earlier commands of the README make (`runs/tiny_model`, `runs/data`, ...);
- every `key=value` override written in the prose names a real key (and a value of its type);
- every repo path (`configs/...`, `bench/...`, `hybridflow/...`, module paths like `parallel/dims.py`,
  `tests/x.py::test_name`, relative links) exists;
- every Python snippet's imports resolve and it uses no name it does not define or import;
- command blocks run from a fresh shell: a block that runs the project's programs enters the venv
  (`source .venv/bin/activate`) or names them by their venv path;
- no `pip install hybridflow...` from the package index (it is not there), no internal references
  (issue numbers, notes a user cannot read), and fences a Markdown renderer reads as intended.

Placeholders a reader replaces (CONFIG, KEY=VALUE, `<dir>`, N, ...) are substituted or skipped.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import importlib
import pathlib
import re
import shlex
import typing

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_IDS = [str(p.relative_to(ROOT)) for p in DOCS]

# ------------------------------------------------------------------ reading Markdown
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


@dataclasses.dataclass
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    text: str


def _split(path: pathlib.Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """Fenced blocks, and the prose lines (number, text) outside them."""
    blocks, prose, open_ = [], [], None
    for i, line in enumerate(path.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if open_ is None:
            if m:
                open_ = (m.group(2), m.group(3).strip(), i, [])
            else:
                prose.append((i, line))
        elif m and m.group(2).startswith(open_[0]) and not m.group(3).strip():
            blocks.append(Block(open_[1], open_[2], "\n".join(open_[3])))
            open_ = None
        else:
            open_[3].append(line)
    if open_ is not None:
        blocks.append(Block(open_[1], open_[2], "\n".join(open_[3])))
    return blocks, prose


def _spans(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Inline code spans `...` of the prose (a span may not cross lines here: the docs never do)."""
    return [(i, m.group(1)) for i, line in prose for m in re.finditer(r"`([^`]+)`", line)]


def _command_lines(block: Block) -> list[tuple[int, str]]:
    """Shell command lines of a block: every line of a bash/sh block, the `$ ` lines of any other;
    backslash continuations joined, comments kept (shlex drops them)."""
    shell = block.lang in ("bash", "sh", "shell", "console")
    out, pending, start = [], "", 0
    for k, raw in enumerate(block.text.splitlines(), block.line + 1):
        line = raw.strip()
        if not pending:
            if line.startswith("$ "):
                line = line[2:]
            elif not shell:
                continue
            start = k
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line and not line.startswith("#"):
            out.append((start, line))
    return out


def _simple_commands(line: str) -> list[list[str]]:
    """`a x && b y | c; d &` -> [[a, x], [b, y], [c], [d]]; comments dropped, env assignments kept."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split, lex.commenters = True, "#"
    try:
        tokens = list(lex)
    except ValueError:  # unbalanced quotes: one command, split on blanks
        tokens = line.split()
    out, cur = [], []
    for t in tokens:
        if t and set(t) <= set(";&|"):
            out, cur = out + [cur] if cur else out, []
        else:
            cur.append(t)
    return out + [cur] if cur else out


def _program(cmd: list[str]) -> tuple[str, str, list[str]]:
    """(program name, its venv prefix or '', its arguments), env assignments skipped."""
    while cmd and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", cmd[0]):
        cmd = cmd[1:]
    if not cmd:
        return "", "", []
    head, venv = cmd[0], ""
    m = re.fullmatch(r"(\.venv[\w-]*)/bin/(.+)", head)
    if m:
        venv, head = m.group(1), m.group(2)
    return head, venv, cmd[1:]


# ------------------------------------------------------------------ placeholders
PLACEHOLDER = re.compile(r"^(\[?[A-Z][A-Z0-9_]*(\.[a-z]+)?\]?|<[^>]*>|\.\.\.|\[\.\.\.\]|[a-z]|[a-z]+\|[a-z|]+)$")


def _is_placeholder(token: str) -> bool:
    return bool(PLACEHOLDER.match(token)) or "<" in token or "$" in token or token == "KEY=VALUE"  # $MODEL: a shell variable


# ------------------------------------------------------------------ keys and values
def _schemas():
    from hybridflow.config import HybridFlowConfig, RewardTrainConfig, SFTConfig

    return (HybridFlowConfig, SFTConfig, RewardTrainConfig)


def _key_exists(schema: type, dotted: str) -> bool:
    """Whether `dotted` names a field of `schema` (any key below a dict field counts)."""
    tp: typing.Any = schema
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(tp):
            return typing.get_origin(tp) is dict or tp is typing.Any
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return False
        tp = hints[part]
        for arg in typing.get_args(tp):  # Optional[Section]
            if dataclasses.is_dataclass(arg) or typing.get_origin(arg) is dict:
                tp = arg
        if typing.get_origin(tp) is dict and i < len(parts) - 1:
            return True
    return True


def _check_override(item: str) -> str | None:
    """None when some config schema takes `key=value` (a placeholder value: the key alone), else why not."""
    from hybridflow.config import ConfigError, load_config

    key, value = item.split("=", 1)
    if _is_placeholder(value) or value == "" or "..." in value:
        return None if any(_key_exists(s, key) for s in _schemas()) else f"no config key {key!r}"
    errors = []
    for schema in _schemas():
        try:
            load_config(None, [item], schema=schema)
            return None
        except ConfigError as e:
            errors.append(str(e))
    return errors[0]


# ------------------------------------------------------------------ running the parsers without running the commands
class _Parsed(Exception):
    def __init__(self, ns):
        self.ns = ns


@pytest.fixture
def parse_only(monkeypatch):
    """argparse parses, then stops the command: flags are checked, nothing runs."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)


def _parse(argv: list[str]) -> argparse.Namespace | None:
    """The namespace of `hybridflow ARGV` (a forwarded command: None once its own parser took ARGV)."""
    from hybridflow.cli import main

    try:
        main(argv)
    except _Parsed as p:
        ns = p.ns
        if getattr(ns, "command", None) is None:
            return None  # a forwarded command's parser (make-model, plan, ...)
        config = getattr(ns, "config", None)
        if config and "=" in config:  # `hybridflow train key=value ...`, as main does
            ns.overrides.insert(0, config)
            ns.config = None
        return ns
    raise AssertionError(f"hybridflow {' '.join(argv)} ran instead of parsing")  # pragma: no cover


DEFAULT_CONFIG = {"train": "configs/grpo_tiny.yaml", "dpo": "configs/dpo_tiny.yaml", "sft": "configs/sft_tiny.yaml", "rm": "configs/rm_tiny.yaml"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir, task_dir):
    """What README's commands make before the later ones run: runs/{tiny_model,sft_model,reward_model,data}."""
    from hybridflow.models.tiny import make_tiny_model

    ws = tmp_path_factory.mktemp("workspace")
    (ws / "runs").mkdir()
    for name in ("tiny_model", "sft_model"):
        (ws / "runs" / name).symlink_to(tiny_model_dir)
    (ws / "runs" / "data").symlink_to(task_dir)
    make_tiny_model(ws / "runs" / "reward_model", hidden_size=32, intermediate_size=64, reward=True)
    for name in ("configs", "examples", "monitoring"):
        (ws / name).symlink_to(ROOT / name)
    return ws


def _validate(sub: str, ns: argparse.Namespace, venv: str, task_dir) -> None:
    """What `hybridflow SUB` checks before Ray or any worker starts, on the parsed command."""
    from hybridflow.config import HybridFlowConfig, RewardTrainConfig, SFTConfig, load_config
    from hybridflow.config.derive import derive_rm_defaults, derive_sft_defaults
    from hybridflow.config.validate import validate_rm_config, validate_sft_config

    overrides = [o for o in ns.overrides if o != "KEY=VALUE" and ("=" in o or not _is_placeholder(o))]  # `...`, `KEY=VALUE`: none
    config = DEFAULT_CONFIG.get(sub) if ns.__dict__.get("config") and _is_placeholder(ns.config) else ns.__dict__.get("config")
    placeholders = [o for o in overrides if _is_placeholder(o.split("=", 1)[1])]
    for o in placeholders:
        assert _check_override(o) is None, _check_override(o)
    overrides = [o for o in overrides if o not in placeholders]
    # vLLM's venv and CUDA runs are validated where they run; here their keys and values are checked
    keys_only = venv == ".venv-vllm" or "trainer.device=cuda" in overrides or placeholders
    if sub in ("train", "dpo"):
        cfg = load_config(config, overrides, schema=HybridFlowConfig)
    elif sub == "demo":  # the overrides go to the recipe's run (the grpo, code and DPO recipes are validated; others: keys)
        from hybridflow import demo

        files = {k: f"{task_dir}/{k}.parquet" for k in ("train", "val", "pref_train")}
        make = {"dpo": demo.demo_dpo_config, "online-dpo": demo.demo_online_dpo_config, "code": demo.demo_code_rl_config}.get(ns.recipe, demo.demo_rl_config)
        cfg = make(files, "runs/tiny_model", "runs/demo/run", ns.rl_steps or 60, *overrides)
        keys_only = keys_only or ns.recipe not in ("grpo", "dpo", "online-dpo", "code")
    elif sub == "sft":
        cfg = derive_sft_defaults(load_config(config, overrides, schema=SFTConfig))
        if not keys_only:
            validate_sft_config(cfg)
        return
    else:
        cfg = derive_rm_defaults(load_config(config, overrides, schema=RewardTrainConfig))
        if not keys_only:
            validate_rm_config(cfg)
        return
    if keys_only:
        return
    from hybridflow.planning.preflight import check_memory
    from hybridflow.trainer.rl import resolve_config
    from hybridflow.trainer.roles import RunRoles

    kind = "dpo" if sub == "dpo" or (sub == "demo" and ns.recipe in ("dpo", "online-dpo")) else "rl"
    cfg = resolve_config(cfg, getattr(ns, "parallel_config", None), {}, kind)
    check_memory(cfg, RunRoles.of(cfg, kind).roles)


def _hybridflow_commands(path: pathlib.Path) -> list[tuple[int, str, list[str]]]:
    """(line, venv, argv) of every `hybridflow ...` in the doc's command blocks and inline spans."""
    blocks, prose = _split(path)
    out = []
    for block in blocks:
        if block.lang not in ("bash", "sh", "shell", "console", ""):
            for k, raw in enumerate(block.text.splitlines(), block.line + 1):
                m = re.search(r"#.*?\b((\.venv[\w-]*/bin/)?hybridflow [a-z].*)$", raw)
                if m:
                    prog, venv, args = _program(_simple_commands(m.group(1))[0])
                    out.append((k, venv, args))
            continue
        for line, text in _command_lines(block):
            for cmd in _simple_commands(text):
                prog, venv, args = _program(cmd)
                if prog == "hybridflow":
                    out.append((line, venv, args))
    for line, span in _spans(prose):
        if re.match(r"(\.venv[\w-]*/bin/)?hybridflow [a-z]", span):
            for cmd in _simple_commands(span):
                prog, venv, args = _program(cmd)
                if prog == "hybridflow" and len(args) > 1 and re.fullmatch(r"[a-z-]+", args[0]):  # `hybridflow export` alone: a name
                    out.append((line, venv, args))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_hybridflow_commands_parse_and_validate(doc, parse_only, workspace, task_dir, monkeypatch):
    from hybridflow.cli import FORWARDED

    monkeypatch.chdir(workspace)
    problems = []
    for line, venv, argv in _hybridflow_commands(doc):
        sub = argv[0]
        if sub in FORWARDED:  # their own parsers; a placeholder stands for any value
            argv = [a if not _is_placeholder(a) or a.startswith("-") else "1" for a in argv]
        where = f"{doc.name}:{line}: hybridflow {' '.join(argv)}"
        try:
            ns = _parse(argv)
        except SystemExit as e:
            if e.code not in (0, None):  # --help exits 0
                problems.append(f"{where}: does not parse ({e})")
            continue
        if ns is None or sub not in ("train", "dpo", "sft", "rm", "demo"):
            continue
        try:
            _validate(sub, ns, venv, task_dir)
        except Exception as e:  # ConfigError, and anything else the checks raise
            problems.append(f"{where}: {type(e).__name__}: {str(e).splitlines()[0][:400]}")
    assert not problems, "\n".join(problems)


OVERRIDE_SPAN = re.compile(r"^[a-z_][a-z0-9_]*(\.[A-Za-z0-9_]+)+=\S.*$")


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_prose_overrides_name_real_keys(doc):
    """Every `key=value` written in the prose (tables, sentences) loads: a real key, a value of its type."""
    _, prose = _split(doc)
    problems = []
    for line, span in _spans(prose):
        try:
            items = shlex.split(span)
        except ValueError:
            items = span.split()
        for item in items:
            if OVERRIDE_SPAN.match(item) and not item.startswith(("hybridflow", "http")):
                why = _check_override(item)
                if why:
                    problems.append(f"{doc.name}:{line}: `{item}`: {why}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ paths
REPO_DIRS = ("configs/", "examples/", "bench/", "scripts/", "tests/", "docs/", "monitoring/", "hybridflow/", ".ci/")
PATH_TOKEN = re.compile(r"^\.?/?[\w.-]+(/[\w.-]+)+\.(py|sh|yaml|yml|md|json|toml|txt)(::[\w.]+)?$")
NOT_REPO = ("runs/", "data/", "checkpoints/", "outputs/", "/", "~", "path/", "your/", "my_")


def _path_problem(token: str, doc: pathlib.Path) -> str | None:
    token = token.strip("'\"(),;:.")
    if not PATH_TOKEN.match(token) or token.startswith(NOT_REPO):
        return None
    file, _, symbol = token.partition("::")
    candidates = [ROOT / file] if file.startswith(REPO_DIRS) else [ROOT / file, ROOT / "hybridflow" / file, doc.parent / file]
    found = next((c for c in candidates if c.exists()), None)
    if found is None:
        return f"`{token}`: no such file in the repository"
    if symbol and not re.search(rf"^\s*(async\s+)?(def|class)\s+{re.escape(symbol.split('.')[-1])}\b|^{re.escape(symbol)}\s*[:=]",
                                found.read_text(), re.M):
        return f"`{token}`: {file} defines no {symbol}"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_referenced_paths_exist(doc):
    blocks, prose = _split(doc)
    tokens = [(line, t) for line, span in _spans(prose) for t in span.split()]
    tokens += [(b.line, t) for b in blocks if b.lang in ("bash", "sh", "") for line in b.text.splitlines() for t in line.split()
               if not line.lstrip().startswith("#")]
    problems = [f"{doc.name}:{line}: {why}" for line, t in tokens if (why := _path_problem(t, doc))]
    for line, text in prose:
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            path = doc.parent / file if file else doc
            if not path.exists():
                problems.append(f"{doc.name}:{line}: link ({target}): no such file")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                problems.append(f"{doc.name}:{line}: link ({target}): {file or doc.name} has no heading #{anchor}")
    assert not problems, "\n".join(problems)


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -."""
    blocks, prose = _split(path)
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for _, line in prose if (m := re.match(r"#{1,6}\s+(.*)", line))}


# ------------------------------------------------------------------ Python snippets
def _bound_and_used(tree: ast.AST) -> tuple[set[str], list[tuple[int, str]]]:
    bound, used = set(dir(builtins)), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
            if not isinstance(node, ast.ClassDef):
                a = node.args
                bound |= {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x}
        elif isinstance(node, ast.Name):
            (bound.add if isinstance(node.ctx, (ast.Store, ast.Del)) else lambda n: used.append((node.lineno, n)))(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, used


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_python_snippets_import_what_they_use(doc):
    """Every ```python block parses, its imports resolve, and every name it reads it defines or imports."""
    blocks, _ = _split(doc)
    problems = []
    for b in (b for b in blocks if b.lang in ("python", "py")):
        where = f"{doc.name}:{b.line}"
        try:
            tree = ast.parse(b.text)
        except SyntaxError as e:
            problems.append(f"{where}: not Python ({e})")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    try:
                        importlib.import_module(a.name)
                    except ImportError as e:
                        problems.append(f"{where}: import {a.name}: {e}")
            elif isinstance(node, ast.ImportFrom) and node.module:
                try:
                    module = importlib.import_module(node.module)
                except ImportError as e:
                    problems.append(f"{where}: from {node.module}: {e}")
                    continue
                for a in node.names:
                    try:
                        getattr(module, a.name)
                    except AttributeError:
                        try:
                            importlib.import_module(f"{node.module}.{a.name}")
                        except ImportError:
                            problems.append(f"{where}: from {node.module} import {a.name}: no such name")
        bound, used = _bound_and_used(tree)
        problems += [f"{where}+{line}: `{name}` is used but never defined or imported" for line, name in used if name not in bound]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ a fresh shell
VENV_PROGRAMS = {"hybridflow", "python", "python3", "torchrun", "pip", "pytest", "ray", "tensorboard"}


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_command_blocks_run_from_a_fresh_shell(doc):
    """A command of the project's venv (hybridflow, python, torchrun, pip, ray, ...) in a block either
    comes after `source .venv/bin/activate` (or `.venv-vllm`'s) in that block, or names its venv
    (`.venv/bin/python`). A fresh shell has neither on its PATH."""
    blocks, _ = _split(doc)
    problems = []
    for b in blocks:
        active = False
        for line, text in _command_lines(b):
            for cmd in _simple_commands(text):
                prog, venv, args = _program(cmd)
                if prog in ("source", ".") and args and re.fullmatch(r"\.venv[\w-]*/bin/activate", args[0]):
                    active = True
                elif prog in VENV_PROGRAMS and not venv and not active:
                    problems.append(f"{doc.name}:{line}: `{' '.join(cmd)[:80]}` needs the venv: start the block with "
                                    f"`source .venv/bin/activate` or write `.venv/bin/{prog}`")
                elif prog in ("pip", "pip3") and any(re.match(r"hybridflow(\[|$)", a) for a in args):
                    problems.append(f"{doc.name}:{line}: `{' '.join(cmd)}`: hybridflow is not on the package index; "
                                    f"from the checkout: pip install -e '.[extra]'")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_pip_extras_exist_and_no_index_installs(doc):
    """`pip install -e '.[x]'` names extras pyproject.toml has; `pip install hybridflow[...]` is not possible."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("optional-dependencies", {}))
    text = doc.read_text()
    problems = [f"{doc.name}: `{m.group(0)}`: hybridflow is not on the package index; from the checkout: pip install -e '.[extra]'"
                for m in re.finditer(r"pip install [^`\n]*?['\"]?hybridflow\[[^\]]*\]", text)]
    for m in re.finditer(r"pip install [^`\n]*?-e ['\"]?\.\[([\w,-]+)\]", text):
        problems += [f"{doc.name}: extra {x!r} is not in pyproject.toml" for x in m.group(1).split(",") if x not in extras]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ what a reader cannot follow
INTERNAL = re.compile(r"\bissue \d+|\bas the issue\b|\bthe (performance )?issue (states|was)|environment notes|\bthis session\b|"
                      r"\bwas lent\b|\bbeen lent\b", re.I)


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_no_internal_references(doc):
    problems = [f"{doc.name}:{i}: {m.group(0)!r}" for i, line in enumerate(doc.read_text().splitlines(), 1)
                for m in INTERNAL.finditer(line)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_fences_open_and_close_as_written(doc):
    """An opening fence's info string is one word: a line starting with ``` inside a paragraph opens a
    code block that swallows the rest of the page."""
    problems, inside = [], False
    for i, line in enumerate(doc.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if not m:
            continue
        info = m.group(3).strip()
        if not inside and len(info.split()) > 1:
            problems.append(f"{doc.name}:{i}: a fence with info string {info[:40]!r} (prose starting with ```?)")
        inside = not inside if (inside and not info) or not inside else inside
    assert not inside or problems, f"{doc.name}: a code fence is never closed"
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_yaml_blocks_showing_a_shipped_file_match_it(doc):
    """A ```yaml block whose first line names a repository file (`# configs/x.yaml ...`) shows that
    file's values (it may show more switches than the file sets)."""
    import yaml

    blocks, _ = _split(doc)
    problems = []
    for b in (b for b in blocks if b.lang in ("yaml", "yml")):
        m = re.match(r"#\s*((configs|examples|monitoring)/[\w./-]+\.ya?ml)\b", b.text)
        if m:
            shown, real = yaml.safe_load(b.text) or {}, yaml.safe_load((ROOT / m.group(1)).read_text()) or {}
            problems += [f"{doc.name}:{b.line}: {m.group(1)}: {k} is {shown.get(k)!r} here, {real.get(k)!r} in the file"
                         for k in sorted(real, key=str) if shown.get(k) != real.get(k)]
    assert not problems, "\n".join(problems)
