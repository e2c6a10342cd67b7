"""Tools a policy may call during a multi-turn rollout, and verl's tool-config YAML.

A tool is a class with an OpenAI function schema and three async verbs, the same life cycle as
verl's ``BaseTool``:

    instance_id = await tool.create(instance_id, **create_kwargs)      # once per trajectory
    result      = await tool.execute(instance_id, parameters, **kw)    # per call -> ToolResult
    await tool.release(instance_id)                                    # trajectory done

Tools are registered by name (``@register_tool("calculator")``); a config names a tool by that
name, by a dotted path (``hybridflow.agent.tools.CalculatorTool``, ``my_pkg.tools.SearchTool``) or
by a file (``/path/to/tools.py:SearchTool``). ``load_tool_config`` reads verl's YAML shape:

    tools:
      - class_name: calculator                # or a dotted path / file path
        config: {type: native, max_exponent: 64}
        tool_schema: {type: function, function: {name: calculator, description: ..., parameters: {...}}}

What is simplified against verl: schemas are plain dicts (validated here) instead of pydantic
models; only ``type: native`` tools exist (MCP servers are out of scope: the rollout machine has no
network); ``execute`` returns one ``ToolResult`` instead of a ``(text, reward, metrics)`` tuple (a
verl-style tuple from a user's tool is still accepted by ``ToolSession``).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import math
import operator
import os
import re
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from hybridflow.agent.registry import class_registry
from hybridflow.agent.threads import in_own_thread
from hybridflow.config.validate import register_check

__all__ = [
    "CalculatorTool",
    "PythonTool",
    "RenderTool",
    "Tool",
    "ToolCall",
    "ToolConfigError",
    "ToolResult",
    "ToolSetupError",
    "ToolSession",
    "get_tool_class",
    "load_tool_config",
    "make_tool",
    "register_tool",
    "truncate_middle",
]


class ToolConfigError(ValueError):
    """A tool config (YAML file, class name, schema or option) cannot be used."""


class ToolSetupError(RuntimeError):
    """The machine cannot run a tool at all (e.g. no sandbox backend). ``ToolSession`` lets this one
    through instead of showing it to the model: every call would fail, so training must stop."""


@dataclass
class ToolResult:
    """What a tool call gives back: the text the model reads next, a reward, and whether it failed.

    ``error`` results are still shown to the model (as the tool message) so it can recover; the
    flag is for metrics and for reward functions that punish broken calls.
    """

    text: str
    reward: float = 0.0
    error: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)
    # images the model sees with the text (a render tool's): PIL images or PNG / JPEG / ... bytes, in order; a VLM's
    # agent loop tokenises them as its processor does (agent/images.py), a text-only model's refuses them
    images: list[Any] = field(default_factory=list)

    @classmethod
    def coerce(cls, value: Any) -> "ToolResult":
        """A ``ToolResult`` from what a tool returned: ours, a string, or verl's ``(text, reward, metrics)``."""
        if isinstance(value, ToolResult):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, tuple) and 1 <= len(value) <= 3:
            text = value[0]
            images = list(getattr(text, "image", None) or [])  # verl >= 0.5's ToolResponse(text, image, video)
            text = getattr(text, "text", text)  # verl >= 0.5 wraps the text in a ToolResponse
            reward = float(value[1]) if len(value) > 1 and value[1] is not None else 0.0
            metrics = dict(value[2]) if len(value) > 2 and isinstance(value[2], Mapping) else {}
            return cls("" if text is None else str(text), reward, False, metrics, images)
        raise TypeError(f"a tool's execute returned {type(value).__name__}; expected ToolResult, str or (text, reward, metrics)")


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: ``name`` and decoded JSON ``arguments`` (a dict)."""

    name: str
    arguments: dict[str, Any]


# ------------------------------------------------------------------------------------ schemas
def validate_schema(schema: Any, where: str = "tool_schema") -> dict:
    """Check an OpenAI function schema ``{type: function, function: {name, description, parameters}}``.

    Returns it unchanged. Why check: a schema with a typo is rendered into the prompt as is and the
    model then learns to call a tool that does not exist; we would rather fail before training.
    """
    if not isinstance(schema, Mapping):
        raise ToolConfigError(f"{where}: expected a mapping, got {type(schema).__name__}")
    if schema.get("type", "function") != "function":
        raise ToolConfigError(f"{where}.type: only 'function' tools exist, got {schema.get('type')!r}")
    fn = schema.get("function")
    if not isinstance(fn, Mapping):
        raise ToolConfigError(f"{where}.function: missing (a mapping with name, description, parameters)")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolConfigError(f"{where}.function.name: missing or not a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        raise ToolConfigError(f"{where}.function.parameters: must be a JSON schema of type 'object'")
    props = params.get("properties", {})
    if not isinstance(props, Mapping):
        raise ToolConfigError(f"{where}.function.parameters.properties: must be a mapping")
    for req in params.get("required", []) or []:
        if req not in props:
            raise ToolConfigError(f"{where}.function.parameters.required: {req!r} is not in properties")
    return dict(schema)


def function_schema(name: str, description: str, properties: dict[str, dict], required: list[str]) -> dict:
    """The OpenAI function schema dict (what ``apply_chat_template(tools=...)`` takes)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


# ------------------------------------------------------------------------------------ base class
class Tool:
    """Base class: one object serves every trajectory; per-trajectory state lives under an instance id.

    Subclasses set ``config_cls`` (a dataclass of their options, so unknown keys fail loudly) and
    ``default_schema`` (used when the YAML gives no ``tool_schema``), and implement ``execute``.
    The constructor signature is verl's, so a verl-style tool ports by changing its base class.
    """

    config_cls: type | None = None
    default_schema: dict | None = None

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None):
        raw = {k: v for k, v in dict(config or {}).items() if k != "type"}  # verl's `type: native`
        self.config = _build_config(type(self), raw)
        schema = tool_schema if tool_schema is not None else self.default_schema
        if schema is None:
            raise ToolConfigError(f"{type(self).__name__}: no tool_schema given and the class has no default_schema")
        self.schema: dict = validate_schema(schema, f"{type(self).__name__}.tool_schema")
        self.name: str = self.schema["function"]["name"]
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start per-trajectory state (``kwargs`` = the row's ``tools_kwargs[name].create_kwargs``)."""
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = dict(kwargs)
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolResult:
        raise NotImplementedError(f"{type(self).__name__}.execute")

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Drop per-trajectory state; releasing an unknown id is a no-op (release may run twice on errors)."""
        self._instances.pop(instance_id, None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _build_config(cls: type, raw: dict) -> Any:
    if cls.config_cls is None:
        return raw
    names = {f.name for f in dataclasses.fields(cls.config_cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ToolConfigError(f"{cls.__name__} config: unknown key(s) {unknown}; known: {sorted(names)}")
    try:
        return cls.config_cls(**raw)
    except (TypeError, ValueError) as e:
        raise ToolConfigError(f"{cls.__name__} config: {e}") from e


# ------------------------------------------------------------------------------------ registry
_TOOLS: dict[str, type[Tool]] = {}


register_tool = class_registry("tool name", _TOOLS)  # a tool class loadable by name in configs


def get_tool_class(spec: str) -> type[Tool]:
    """Resolve ``"calculator"`` | ``"pkg.module.ClassName"`` (or ``pkg.module:ClassName``) | ``"/path/to/file.py:ClassName"``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ToolConfigError(f"class_name: expected a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in _TOOLS:
        return _TOOLS[spec]
    if ":" in spec and (spec.rsplit(":", 1)[0].endswith(".py") or os.sep in spec):
        path, cls_name = spec.rsplit(":", 1)
        obj = getattr(_import_file(path), cls_name, None)
        where = f"{path}"
    elif "." in spec or ":" in spec:
        mod_name, cls_name = spec.rsplit(":", 1) if ":" in spec else spec.rsplit(".", 1)
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            hint = " (verl's own tools are not bundled: port the class onto hybridflow.agent.tools.Tool)" if mod_name.startswith("verl.") else ""
            raise ToolConfigError(f"class_name {spec!r}: cannot import module {mod_name!r}: {e}{hint}") from e
        obj = getattr(module, cls_name, None)
        where = f"module {mod_name}"
    else:
        raise ToolConfigError(f"class_name {spec!r}: not a registered tool (known: {sorted(_TOOLS)}), "
                              "a dotted path 'pkg.module.Class' or a file 'path/to/file.py:Class'")
    if obj is None:
        raise ToolConfigError(f"class_name {spec!r}: no {cls_name!r} in {where}")
    if not (isinstance(obj, type) and issubclass(obj, Tool)):
        raise ToolConfigError(f"class_name {spec!r}: {obj!r} is not a subclass of hybridflow.agent.tools.Tool")
    return obj


def _import_file(path: str):
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ToolConfigError(f"tool file not found: {path}")
    mod_name = "hybridflow_user_tool_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ToolConfigError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # pickling (Ray) and dataclasses look classes up here
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise ToolConfigError(f"importing tool file {path} failed: {type(e).__name__}: {e}") from e
    return module


def make_tool(class_name: str, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None) -> Tool:
    """Build one tool from its class spec (registry name, dotted path or file path)."""
    return get_tool_class(class_name)(config=config, tool_schema=tool_schema)


@register_check("tool_config")
def tool_config_problems(path: str) -> list[str]:
    """The config validator's check: the tool YAML loads (classes, schemas, options) before any worker starts."""
    try:
        load_tool_config(path)
    except ToolConfigError as e:
        return [f"actor_rollout_ref.rollout.multi_turn.tool_config_path: {e}"]
    return []


def load_tool_config(path: str | os.PathLike) -> list[Tool]:
    """Tools from a verl-shaped YAML file (``tools: [{class_name, config, tool_schema}]``).

    Every error names the file and the entry (``tools[1] (class_name='x')``) so a user fixes the
    right line; names must be unique because the model calls tools by name.
    """
    import yaml

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ToolConfigError(f"tool config file not found: {path}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ToolConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, Mapping) or not isinstance(data.get("tools"), list):
        raise ToolConfigError(f"{path}: expected a top-level 'tools:' list of {{class_name, config, tool_schema}} entries")
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(data["tools"]):
        label = f"{path}: tools[{i}]"
        if not isinstance(entry, Mapping):
            raise ToolConfigError(f"{label}: expected a mapping with class_name, config, tool_schema; got {entry!r}")
        label += f" (class_name={entry.get('class_name')!r})"
        unknown = sorted(set(entry) - {"class_name", "config", "tool_schema"})
        if unknown:
            raise ToolConfigError(f"{label}: unknown key(s) {unknown}; expected class_name, config, tool_schema")
        if "class_name" not in entry:
            raise ToolConfigError(f"{label}: missing class_name")
        config = entry.get("config") or {}
        if not isinstance(config, Mapping):
            raise ToolConfigError(f"{label}: config must be a mapping, got {type(config).__name__}")
        kind = config.get("type", "native")
        if kind != "native":
            raise ToolConfigError(f"{label}: config.type {kind!r} is not supported (only 'native'; MCP tools need a network)")
        try:
            tool = make_tool(entry["class_name"], config, entry.get("tool_schema"))
        except ToolConfigError as e:
            raise ToolConfigError(f"{label}: {e}") from e
        if tool.name in seen:
            raise ToolConfigError(f"{label}: tool name {tool.name!r} is already used by tools[{seen[tool.name]}]")
        seen[tool.name] = i
        tools.append(tool)
    return tools


# ------------------------------------------------------------------------------------ session
class ToolSession:
    """One trajectory's view of the tools: creates an instance on first use, never raises on a call.

    ``tools_kwargs`` is the row's ``extra_info.tools_kwargs`` in verl's shape:
    ``{tool_name: {"create_kwargs": {...}, "execute_kwargs": {...}, "release_kwargs": {...}}}``.
    A failing tool, an unknown name or bad arguments become an error ``ToolResult`` (the model sees
    the message and the rollout goes on) — a tool bug must not kill a training step. Only
    ``ToolSetupError`` (the machine cannot run the tool at all) propagates.
    """

    def __init__(self, tools: Mapping[str, Tool] | list[Tool], tools_kwargs: Mapping[str, Any] | None = None):
        self.tools: dict[str, Tool] = dict(tools) if isinstance(tools, Mapping) else {t.name: t for t in tools}
        self.tools_kwargs = dict(tools_kwargs or {})
        self.instance_ids: dict[str, str] = {}

    def _kw(self, name: str, stage: str) -> dict:
        return dict((self.tools_kwargs.get(name) or {}).get(stage) or {})

    async def call(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"unknown tool {call.name!r}; available: {', '.join(sorted(self.tools)) or 'none'}", error=True)
        if not isinstance(call.arguments, Mapping):
            return ToolResult(f"arguments of {call.name!r} must be a JSON object", error=True)
        try:
            if call.name not in self.instance_ids:
                self.instance_ids[call.name] = await tool.create(None, **self._kw(call.name, "create_kwargs"))
            out = await tool.execute(self.instance_ids[call.name], dict(call.arguments), **self._kw(call.name, "execute_kwargs"))
            return sanitized(ToolResult.coerce(out))
        except ToolSetupError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to the model as the tool's answer
            return sanitized(ToolResult(f"tool {call.name!r} failed: {type(e).__name__}: {e}", error=True))

    async def close(self) -> None:
        ids, self.instance_ids = self.instance_ids, {}
        for name, iid in ids.items():
            try:
                await self.tools[name].release(iid, **self._kw(name, "release_kwargs"))
            except Exception:  # noqa: BLE001 - release is best effort; the trajectory is finished
                pass

    async def __aenter__(self) -> "ToolSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


# C0 controls but \t and \n, DEL, and C1 controls: a terminal escape (ESC [ ...), NUL or CR from a tool
# would reach the prompt and the logs as is (and a log viewer or terminal would interpret them).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def sanitized(result: ToolResult) -> ToolResult:
    """``result`` with control characters other than newline and tab removed from its text; how
    many were removed is in ``metrics["control_chars"]`` (when any; the agent loop sums it per step)."""
    text, n = _CONTROL.subn("", result.text)
    if n == 0:
        return result
    return dataclasses.replace(result, text=text, metrics={**result.metrics, "control_chars": n})


def truncate_middle(text: str, limit: int) -> str:
    """Keep the head and tail of ``text`` within ``limit`` chars (errors are usually at the end)."""
    if limit <= 0 or len(text) <= limit:
        return text
    marker = f"\n...[{len(text) - limit} chars truncated]...\n"
    keep = max(limit - len(marker), 0)
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head):]


# ------------------------------------------------------------------------------------ calculator
class CalcError(ValueError):
    """An expression the calculator refuses (the message goes to the model)."""


@dataclass
class CalculatorConfig:
    max_chars: int = 500  # longer input is refused before parsing (deep nesting costs recursion)
    max_exponent: int = 1024  # |exponent| of **
    max_digits: int = 300  # |result| < 10**max_digits for every intermediate value (floats: finite)


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def evaluate_arithmetic(expr: str, cfg: CalculatorConfig | None = None) -> int | float:
    """Evaluate ``+ - * / // % **``, unary ``-``/``+`` and parentheses over int/float literals.

    Walks the ``ast`` tree itself — no ``eval`` — and refuses anything else (names, calls,
    attributes, strings, comparisons). Every intermediate value is bounded, and ``**`` is checked
    *before* it is computed (digits ~ exponent * log10|base|), so ``9**9**9`` fails in microseconds.
    """
    cfg = cfg or CalculatorConfig()
    if not isinstance(expr, str) or not expr.strip():
        raise CalcError("empty expression")
    if len(expr) > cfg.max_chars:
        raise CalcError(f"expression too long ({len(expr)} > {cfg.max_chars} chars)")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise CalcError(f"syntax error: {e.msg}") from None
    except (RecursionError, MemoryError):
        raise CalcError("expression nested too deeply") from None
    limit = 10**cfg.max_digits

    def check(x: int | float) -> int | float:
        if isinstance(x, complex):
            raise CalcError("result is not a real number")
        if isinstance(x, float) and not math.isfinite(x):
            raise CalcError("result overflows")
        if abs(x) >= limit:
            raise CalcError(f"result too large (more than {cfg.max_digits} digits)")
        return x

    def pow_checked(base: int | float, exp: int | float) -> int | float:
        if abs(exp) > cfg.max_exponent:
            raise CalcError(f"exponent too large (|{exp}| > {cfg.max_exponent})")
        if abs(base) > 1 and exp > 0 and exp * math.log10(abs(base)) >= cfg.max_digits:
            raise CalcError(f"result too large (more than {cfg.max_digits} digits)")
        return base**exp

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            if type(node.value) in (int, float):  # bool is an int subclass: refused on purpose
                return check(node.value)
            raise CalcError(f"unsupported literal {node.value!r}: only numbers")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else +v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                return check(pow_checked(a, b))
            return check(_BINOPS[type(node.op)](a, b))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
            raise CalcError("'^' is not a power here: use '**'")
        what = type(getattr(node, "op", node)).__name__
        raise CalcError(f"unsupported syntax: {what} (only numbers, + - * / // % **, unary -, parentheses)")

    try:
        return ev(tree)
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except OverflowError:
        raise CalcError("result overflows") from None
    except RecursionError:
        raise CalcError("expression nested too deeply") from None


def format_number(x: int | float) -> str:
    """Ints exactly; floats with 15 significant digits (``0.1+0.2`` -> ``0.3``, not ``0.30000000000000004``)."""
    return str(x) if isinstance(x, int) else format(x, ".15g")


@register_tool("calculator")
class CalculatorTool(Tool):
    """Arithmetic for math tasks; a refused or failing expression is a tool error, never an exception."""

    config_cls = CalculatorConfig
    default_schema = function_schema(
        "calculator",
        "Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses.",
        {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2 ** 3"}},
        ["expression"],
    )

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolResult:
        expr = parameters.get("expression")
        if not isinstance(expr, str):
            return ToolResult("missing string argument 'expression'", error=True)
        try:
            return ToolResult(format_number(evaluate_arithmetic(expr, self.config)))
        except CalcError as e:
            return ToolResult(f"error: {e}", error=True)


# ------------------------------------------------------------------------------------ render
@register_tool("render")
class RenderTool(Tool):
    """Shows the row's canvas in colour (the ``vision_render`` task, `data/vision_task.py`): the row's
    ``tools_kwargs.render.create_kwargs`` name the circle (colour, cx, cy, r, size); the result is its PNG, which a
    vision-language policy reads as the tool message's image tokens (`agent/images.py`). A text-only policy cannot
    take it (the agent loop refuses a tool image without a processor)."""

    default_schema = function_schema("render", "Show the canvas in colour.", {}, [])

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolResult:
        from hybridflow.data.vision_task import COLOURS, draw_circle, png_bytes

        shape = self._instances.get(instance_id) or {}
        try:
            img = draw_circle(shape["colour"], int(shape["cx"]), int(shape["cy"]), int(shape["r"]), int(shape.get("size", 56)))
        except (KeyError, TypeError, ValueError) as e:
            return ToolResult(f"error: nothing to render ({type(e).__name__}: {e}); the row's tools_kwargs.render.create_kwargs "
                              f"must name colour (one of {', '.join(COLOURS)}), cx, cy, r", error=True)
        return ToolResult("rendered", images=[png_bytes(img)])


# ------------------------------------------------------------------------------------ python
@dataclass
class PythonToolConfig:
    max_output_chars: int = 2000  # per stream; the middle is cut (see truncate_middle)
    # SandboxLimits fields (sandbox/core.py): cpu_s, memory_mb, max_procs, file_size_mb, wall_s, output_bytes,
    # tmp_mb, open_files; checked when the config loads (a typo or a limit <= 0 is refused there, naming the key)
    limits: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.limits:
            return
        from hybridflow.agent.sandbox import LIMIT_FIELDS, SandboxLimits  # cheap: starts nothing

        if not isinstance(self.limits, Mapping):
            raise ValueError(f"limits: expected a mapping of {list(LIMIT_FIELDS)}, got {self.limits!r}")
        for key in self.limits:
            if key not in LIMIT_FIELDS:
                close = difflib.get_close_matches(str(key), LIMIT_FIELDS, n=1)
                hint = f"; did you mean limits.{close[0]}?" if close else ""
                raise ValueError(f"limits.{key}: not a sandbox limit (known: {', '.join(LIMIT_FIELDS)}){hint}")
        try:
            SandboxLimits(**self.limits)
        except ValueError as e:  # "SandboxLimits.wall_s must be a number > 0, got 0"
            raise ValueError(str(e).replace("SandboxLimits.", "limits.")) from None


@register_tool("python")
class PythonTool(Tool):
    """Runs the model's code in ``hybridflow.agent.sandbox`` (a separate, locked-down process).

    The sandbox is imported on first use so that configs load (and other tools work) on machines
    where the sandbox cannot start. The sandbox call blocks, so it runs in a worker thread: the
    event loop keeps serving other trajectories meanwhile.
    """

    config_cls = PythonToolConfig
    default_schema = function_schema(
        "python",
        "Run a Python 3 program and return what it prints (stdout and stderr). No network, no files kept between calls.",
        {"code": {"type": "string", "description": "a complete program; print() what you want to see"}},
        ["code"],
    )

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolResult:
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResult("missing string argument 'code'", error=True)
        from hybridflow.agent import sandbox  # lazy: see the class docstring

        limits = _sandbox_limits(sandbox, {**self.config.limits, **dict(kwargs.get("limits") or {})})
        try:
            res = await in_own_thread(sandbox.run_python, code, limits)
        except getattr(sandbox, "SandboxUnavailable", ()) as e:
            raise ToolSetupError(f"python tool: no sandbox on this machine: {e}") from e
        return sandbox_result_to_tool_result(res, self.config.max_output_chars)


def _sandbox_limits(sandbox_mod: Any, overrides: dict[str, Any]) -> Any:
    """The sandbox's ``SandboxLimits`` with ``overrides`` applied; None (the sandbox's defaults) when there are none."""
    cls = getattr(sandbox_mod, "SandboxLimits", None)
    if not overrides or cls is None:
        return overrides or None
    try:
        return cls(**overrides)
    except (TypeError, ValueError) as e:
        raise ToolConfigError(f"python tool: bad sandbox limits {overrides}: {e}") from e


def sandbox_result_to_tool_result(res: Any, max_chars: int) -> ToolResult:
    """Text the model reads for a sandbox run (duck-typed: stdout, stderr, exit_code, timed_out, killed_reason)."""
    out = truncate_middle(_text(getattr(res, "stdout", "")), max_chars)
    err = truncate_middle(_text(getattr(res, "stderr", "")), max_chars)
    code = getattr(res, "exit_code", None)
    timed_out = bool(getattr(res, "timed_out", False))
    killed = getattr(res, "killed_reason", None)
    parts = [out.rstrip("\n")] if out else []
    if err:
        parts.append("stderr:\n" + err.rstrip("\n"))
    if getattr(res, "truncated", False):
        parts.append("[output over the sandbox's limit was dropped]")
    if timed_out:
        parts.append("error: the program timed out and was stopped")
    elif killed:
        parts.append(f"error: the program was killed ({killed})")
    elif code not in (0, None):
        parts.append(f"error: exit code {code}")
    text = "\n".join(parts) if parts else "(no output)"
    metrics = {"exit_code": code, "timed_out": timed_out, "sandbox_killed": timed_out or bool(killed)}
    enforcement = getattr(res, "enforcement", None)
    if enforcement is not None:  # which protections held (a weaker sandbox is counted, never silent)
        metrics["sandbox_weaker"] = int(not enforcement.full)
    return ToolResult(text, error=timed_out or bool(killed) or code not in (0, None), metrics=metrics)


def _text(x: Any) -> str:
    if isinstance(x, bytes):
        return x.decode("utf-8", errors="replace")
    return "" if x is None else str(x)
