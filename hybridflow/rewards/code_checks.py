"""Assert-style checks graded outside the solution's process: parse, split, compare.

Why: a solution that runs in the grader's process can reach the grader (its frames, the verdict
pipe, the standard library it reports with) and can return objects whose ``__eq__`` is always
true. So the host (this module, in the trainer) never lets the solution see the expected side of
a check or decide a verdict:

1. :func:`plan_check` parses a check (``assert f(1) == 2``; ``assert abs(f(x) - 0.5) < 1e-6``;
   ``assert isinstance(f(x), int)``; several statements; HumanEval's ``def check(candidate)`` +
   ``check(fn)``; see docs/agents.md) into *steps* for the sandbox: statements to run and
   expressions to evaluate (the "holes"), and, per ``assert``, a tree for the host to evaluate.
2. A hole is a largest part of an assert that uses the solution's names and holds none of the
   check's own values (no constant, no name of the check's, except as an argument of a call to
   the solution's code: those are the inputs). ``f(x) == 3`` sends ``f(x)``;
   ``abs(f(3.5) - 0.5) < 1e-6`` sends ``f(3.5)``; ``str(Node(1)) == "1"`` sends ``str(Node(1))``;
   ``isinstance`` and ``type`` always run here. Whatever a hole evaluates to is the solution's
   *claim* about its own code: no more than a function returning that value could claim.
3. The sandbox (``code_eval_harness.py``) answers each step with a value as plain data (None,
   bools, ints, floats, complex, str, bytes, list, tuple, dict, set, frozenset; nothing else),
   :func:`decode_value` rebuilds it with exact built-in types, and :func:`evaluate` computes the
   assert here with the check's own values, in a small interpreter over the AST (literals,
   arithmetic with size bounds, comparisons, a list of pure built-ins, ``math``, safe methods of
   plain values).

A check that does not fit (loops, ``try``, comprehensions around the solution's calls, ...) raises
:class:`NotGradable`: the caller grades it in-process (``code_harness.py``) and counts it, or
refuses it under strict grading.
"""

from __future__ import annotations

import ast
import builtins
import functools
import json
import math
import operator
from dataclasses import dataclass, field
from typing import Any

MAX_DEPTH = 100  # nesting of a value from the sandbox (lists in lists ...)
MAX_ITEMS = 1_000_000  # elements a host-side operation may create (sequence * n, range, ...)
MAX_POW_BITS = 100_000  # bits of an int ** int computed here


class NotGradable(ValueError):
    """The check has a shape this module cannot grade outside the solution's process."""


class CheckFailed(Exception):
    """An assert evaluated to false or could not be evaluated here; the message says why."""


# ---------------------------------------------------------------------- plans
@dataclass(frozen=True)
class Step:
    """One thing the sandbox does, in order: run a statement (``exec``) or evaluate a hole (``eval``)."""

    kind: str  # "exec" | "eval"
    source: str


@dataclass
class Plan:
    """A check as sandbox steps plus the host's side, in the check's order: ``host_ops`` holds
    ``("assign", name, expr)`` (a value of the check's own) and ``("assert", upto, test, source)``
    (decided once steps ``< upto`` are answered; holes in ``test`` are ``_hole(i)`` calls)."""

    steps: list[Step] = field(default_factory=list)
    host_ops: list[tuple] = field(default_factory=list)
    host_env: dict[str, Any] = field(default_factory=dict)  # the check's imports of math


def _safe_range(*args):
    r = range(*args)
    if len(r) > MAX_ITEMS:
        raise CheckFailed(f"range of {len(r)} items is over the grader's bound {MAX_ITEMS}")
    return r


def _materialize(fn):
    """zip / enumerate / reversed / map return iterators; here they return lists (no laziness to bound)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return list(fn(*args, **kwargs))

    return wrapped


# The built-ins the host evaluates with: pure, bounded by their inputs' size (which MAX_* and the
# sandbox's output limit bound). Not here: anything that reads, writes, imports or runs code.
HOST_BUILTINS: dict[str, Any] = {
    **{n: getattr(builtins, n) for n in (
        "abs", "all", "any", "bool", "bytes", "chr", "complex", "dict", "divmod", "float", "frozenset", "hash", "int",
        "isinstance", "len", "list", "max", "min", "ord", "repr", "round", "set", "sorted", "str", "sum", "tuple", "type")},
    "math": None,  # set below: checks use math without importing it (MBPP's math.isclose)
    "range": _safe_range, "zip": _materialize(zip), "enumerate": _materialize(enumerate), "reversed": _materialize(reversed),
}
# math without the functions whose cost grows with an int argument's value
_MATH_SKIP = {"factorial", "comb", "perm", "prod", "lcm", "gcd"}
MATH_NAMES = {n: getattr(math, n) for n in dir(math) if not n.startswith("_") and n not in _MATH_SKIP}
# Methods of plain values the host calls; none of them can grow a value past its input's size by much.
HOST_METHODS = {
    str: {"lower", "upper", "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith", "endswith",
          "count", "find", "rfind", "index", "rindex", "isdigit", "isalpha", "isalnum", "isspace", "islower", "isupper",
          "isnumeric", "isdecimal", "istitle", "title", "capitalize", "swapcase", "casefold", "partition", "rpartition"},
    bytes: {"decode", "startswith", "endswith", "count", "find", "index", "hex"},
    list: {"count", "index"},
    tuple: {"count", "index"},
    dict: {"keys", "values", "items", "get"},
    set: {"union", "intersection", "difference", "symmetric_difference", "issubset", "issuperset", "isdisjoint"},
    frozenset: {"union", "intersection", "difference", "symmetric_difference", "issubset", "issuperset", "isdisjoint"},
}
ALL_HOST_METHODS = set().union(*HOST_METHODS.values())
# Methods whose answer is a verdict about the value (``f(x).startswith("ab")``): always called here,
# on the plain value, so a look-alike object cannot answer them. Other methods on the solution's
# values are the solution's calls (``cache.get(1)``, ``f(x).count("a")``): their arguments are inputs
# and their results are claims the host compares further.
PREDICATE_METHODS = {m for m in ALL_HOST_METHODS if m.startswith("is") or m in ("startswith", "endswith")}
_ALWAYS_HOST_CALLS = {"isinstance", "type"}  # their answer is about the value's type: never the solution's to give


class _MathModule:
    """``math`` as the check's namespace sees it on the host (only MATH_NAMES)."""

    def __getattr__(self, name):
        if name in MATH_NAMES:
            return MATH_NAMES[name]
        raise CheckFailed(f"math.{name} is not available to the grader")


_MATH = _MathModule()
HOST_BUILTINS["math"] = _MATH
# Modules a check may call on its own values (np.allclose(f(x), 5)): such a call is neither the
# solution's code nor the grader's, so the check is graded in-process, not sent as a hole.
FOREIGN_MODULES = {"np", "numpy", "re", "heapq", "collections", "itertools", "functools", "operator", "string",
                   "random", "sys", "os", "cmath", "statistics", "fractions", "decimal", "json", "copy", "bisect"}


@functools.lru_cache(maxsize=4096)
def plan_check(check: str) -> Plan:
    """The sandbox steps and the host's asserts of one check (NotGradable when it does not fit)."""
    try:
        tree = ast.parse(check)
    except SyntaxError as e:
        raise NotGradable(f"the check is not valid Python: {e}") from None
    body = _inline_humaneval(tree.body)
    plan = Plan()
    host: dict[str, ast.stmt] = {}  # the check's own names bound by a host-side assignment (sent to the sandbox if a hole uses them)
    solution_bound: set[str] = set()  # names the sandbox's steps bind (they belong to the solution's side)
    sent: set[str] = set()

    def is_host_name(name: str) -> bool:
        if name in solution_bound:
            return False
        return name in host or name in plan.host_env or name in HOST_BUILTINS

    def send_inputs(node: ast.AST) -> None:
        """A hole or a statement for the sandbox uses some of the check's own names: send their
        assignments first (inputs, e.g. ``x = [1, 2]`` in ``assert f(x) == 3``)."""
        for name in sorted(_free_names(node)):
            if name in host and name not in sent and name not in solution_bound:
                sent.add(name)
                send_inputs(host[name].value)
                plan.steps.append(Step("exec", ast.unparse(host[name])))

    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            plan.steps.append(Step("exec", ast.unparse(stmt)))  # the sandbox may need the module for a hole
            _bind_import(stmt, plan.host_env)
        elif isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
            continue  # a docstring
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            if _uses_solution(stmt.value, is_host_name):
                send_inputs(stmt.value)
                plan.steps.append(Step("exec", ast.unparse(stmt)))
                solution_bound.add(name)
                host.pop(name, None)
            else:
                _check_host_expr(stmt.value)
                host[name] = stmt
                solution_bound.discard(name)
                sent.discard(name)
                plan.host_ops.append(("assign", name, stmt.value))
        elif isinstance(stmt, ast.Expr) and _uses_solution(stmt.value, is_host_name):
            send_inputs(stmt.value)
            plan.steps.append(Step("exec", ast.unparse(stmt)))  # e.g. obj.push(1): run for its effect
        elif isinstance(stmt, ast.Assert):
            test = _split(stmt.test, is_host_name, plan, send_inputs)
            plan.host_ops.append(("assert", len(plan.steps), test, ast.unparse(stmt.test)))
        else:
            raise NotGradable(f"a {type(stmt).__name__} statement in a check (only assert, import, assignment, calls)")
    if not any(op[0] == "assert" for op in plan.host_ops):
        raise NotGradable("the check has no assert")
    return plan


def _inline_humaneval(body: list[ast.stmt]) -> list[ast.stmt]:
    """HumanEval's test shape, ``def check(candidate): <asserts>`` then ``check(fn)``: the asserts
    with ``candidate`` renamed to ``fn``, in place of the call."""
    defs = {s.name: s for s in body if isinstance(s, ast.FunctionDef) and len(s.args.args) == 1 and not s.decorator_list}
    out: list[ast.stmt] = []
    for s in body:
        if isinstance(s, ast.FunctionDef) and s.name in defs:
            continue
        call = s.value if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) else None
        if call is not None and isinstance(call.func, ast.Name) and call.func.id in defs and len(call.args) == 1 \
                and isinstance(call.args[0], ast.Name) and not call.keywords:
            fn = defs[call.func.id]
            out += [_Rename(fn.args.args[0].arg, call.args[0].id).visit(ast.parse(ast.unparse(st)).body[0]) for st in fn.body]
        else:
            out.append(s)
    return out  # a def that is never called asserts nothing (as in Python); no assert left: NotGradable


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.copy_location(ast.Name(self.new if node.id == self.old else node.id, node.ctx), node)


def _bind_import(stmt: ast.stmt, env: dict[str, Any]) -> None:
    """The host knows one module, ``math``; other imports only reach the sandbox."""
    if isinstance(stmt, ast.Import):
        for a in stmt.names:
            if a.name == "math":
                env[a.asname or "math"] = _MATH
    elif stmt.module == "math":
        for a in stmt.names:
            if a.name == "*":
                env.update(MATH_NAMES)
            elif a.name in MATH_NAMES:
                env[a.asname or a.name] = MATH_NAMES[a.name]


def _free_names(node: ast.AST) -> set[str]:
    """Names read in ``node``, minus those its comprehensions and lambdas bind."""
    bound: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.comprehension):
            bound |= {t.id for t in ast.walk(n.target) if isinstance(t, ast.Name)}
        elif isinstance(n, ast.Lambda):
            bound |= {a.arg for a in n.args.args + n.args.kwonlyargs}
        elif isinstance(n, ast.NamedExpr):
            bound.add(n.target.id)
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def _uses_solution(node: ast.AST, is_host_name) -> bool:
    return any(not is_host_name(n) for n in _free_names(node))


def _is_solution_call(node: ast.Call, is_host_name) -> bool:
    """A call into the solution's code: its arguments are the check's inputs."""
    f = node.func
    if isinstance(f, ast.Name):
        return not is_host_name(f.id)
    if isinstance(f, ast.Attribute):
        if isinstance(f.value, ast.Name) and (is_host_name(f.value.id) or f.value.id in FOREIGN_MODULES):
            return False  # math.sqrt(...), np.allclose(...)
        return f.attr not in PREDICATE_METHODS and _uses_solution(f.value, is_host_name)
    return _uses_solution(f, is_host_name)


def _leaks(node: ast.AST, is_host_name) -> bool:
    """Does ``node`` hold a value of the check's own outside the arguments of the solution's calls?"""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name):
        return is_host_name(node.id)
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name) and f.id in _ALWAYS_HOST_CALLS and is_host_name(f.id):
            return True
        if _is_solution_call(node, is_host_name):
            return _leaks(f, is_host_name) if isinstance(f, ast.Attribute) else False
        callee_is_host = (isinstance(f, ast.Name) and is_host_name(f.id)) or (
            isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and is_host_name(f.value.id))
        parts = [*node.args, *(k.value for k in node.keywords)] + ([] if callee_is_host else [f])
        return any(_leaks(p, is_host_name) for p in parts)
    if isinstance(node, ast.Attribute):
        return _leaks(node.value, is_host_name)
    return any(_leaks(c, is_host_name) for c in ast.iter_child_nodes(node))


_HOST_NODES = (ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.IfExp, ast.Call, ast.Subscript, ast.Slice,
               ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Attribute)


def _split(node: ast.expr, is_host_name, plan: Plan, send_inputs) -> ast.expr:
    """``node`` with each hole replaced by ``_hole(i)`` (i: its step), holes appended to the plan."""
    if not _uses_solution(node, is_host_name):
        _check_host_expr(node)
        return node
    if not _leaks(node, is_host_name):
        send_inputs(node)
        plan.steps.append(Step("eval", ast.unparse(node)))
        return ast.Call(ast.Name("_hole", ast.Load()), [ast.Constant(len(plan.steps) - 1)], [])
    if not isinstance(node, _HOST_NODES) or (isinstance(node, ast.Call) and _is_solution_call(node, is_host_name)):
        raise NotGradable(f"cannot grade {ast.unparse(node)!r} outside the solution's process "
                          f"(the check's own values sit inside a {type(node).__name__})")
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in FOREIGN_MODULES \
                and not is_host_name(f.value.id):
            raise NotGradable(f"{ast.unparse(f)}(...) on the check's own values is neither the solution's code nor the grader's")
        new_f = f if not isinstance(f, ast.Attribute) else ast.Attribute(_split(f.value, is_host_name, plan, send_inputs), f.attr, ast.Load())
        if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and is_host_name(f.value.id)) \
                and f.attr not in ALL_HOST_METHODS:
            raise NotGradable(f"method {f.attr!r} is not one the grader calls on plain values")
        args = [_split(a, is_host_name, plan, send_inputs) for a in node.args]
        kws = [ast.keyword(k.arg, _split(k.value, is_host_name, plan, send_inputs)) for k in node.keywords]
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            raise NotGradable("*args / **kwargs in a host-side call")
        return ast.Call(new_f, args, kws)
    new = type(node)(**{f: _split_field(getattr(node, f), is_host_name, plan, send_inputs) for f in node._fields})
    return new


def _split_field(value, is_host_name, plan, send_inputs):
    if isinstance(value, ast.expr):
        return _split(value, is_host_name, plan, send_inputs)
    if isinstance(value, list):
        return [_split_field(v, is_host_name, plan, send_inputs) for v in value]
    return value


_SUPPORTED = (ast.Constant, ast.Name, ast.Load, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp,
              ast.BoolOp, ast.Compare, ast.IfExp, ast.Call, ast.keyword, ast.Subscript, ast.Slice, ast.Attribute,
              ast.unaryop, ast.operator, ast.boolop, ast.cmpop)


def _check_host_expr(node: ast.AST) -> None:
    """Refuse, when planning, what :func:`evaluate` would not run (comprehensions, lambdas, ...)."""
    for n in ast.walk(node):
        if not isinstance(n, _SUPPORTED):
            raise NotGradable(f"a {type(n).__name__} in the check's own values ({ast.unparse(node)!r})")
        if isinstance(n, ast.Attribute) and not isinstance(n.value, ast.Name) and n.attr not in ALL_HOST_METHODS:
            raise NotGradable(f"attribute {n.attr!r} in the check's own values")
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id not in HOST_BUILTINS:
            pass  # a name the check binds (a lambda would have been refused): evaluate() says if it is not callable


# ---------------------------------------------------------------------- values from the sandbox
_SCALARS = {"int": int, "float": float}


def decode_value(data: Any, depth: int = 0) -> Any:
    """A value from the sandbox's tagged JSON (see code_eval_harness.encode) with exact built-in types;
    ValueError for anything else."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH}")
    if data is None or type(data) in (bool, str):
        return data
    if type(data) is list:
        return [decode_value(x, depth + 1) for x in data]
    if type(data) is not dict or len(data) != 1:
        raise ValueError(f"not a tagged value: {str(data)[:80]!r}")
    (tag, v), = data.items()
    if tag in _SCALARS and type(v) is str:
        return _SCALARS[tag](v)
    if tag == "complex" and type(v) is list and len(v) == 2 and all(type(x) is str for x in v):
        return complex(float(v[0]), float(v[1]))
    if tag == "bytes" and type(v) is str:
        return bytes.fromhex(v)
    if tag in ("tuple", "set", "frozenset") and type(v) is list:
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode_value(x, depth + 1) for x in v)
    if tag == "dict" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
        return {decode_value(k, depth + 1): decode_value(x, depth + 1) for k, x in v}
    raise ValueError(f"unknown value tag {tag!r}")


def parse_answers(stdout: str, steps: list[Step]) -> dict[int, tuple[bool, Any]]:
    """{step: (True, value) | (False, why)} from the sandbox's answer lines. A step answered twice
    gets (False, why): every answer is the solution's claim, and two claims for one step are a lie."""
    out: dict[int, tuple[bool, Any]] = {}
    seen: set[int] = set()
    for line in stdout.splitlines():
        try:
            msg = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue  # a torn last line (killed while writing) or noise
        if type(msg) is not dict or type(msg.get("i")) is not int or not 0 <= msg["i"] < len(steps):
            continue
        i = msg["i"]
        if i in seen:
            out[i] = (False, "the step was answered twice")
            continue
        seen.add(i)
        if "err" in msg:
            out[i] = (False, _clean(str(msg["err"])))
        elif "v" in msg and steps[i].kind == "eval":
            try:
                out[i] = (True, decode_value(msg["v"]))
            except (ValueError, TypeError, OverflowError, RecursionError) as e:
                out[i] = (False, f"not a plain value ({_clean(str(e))})")
        elif steps[i].kind == "exec":
            out[i] = (True, None)
    return out


def _clean(s: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in s)[:300]


# ---------------------------------------------------------------------- the host's evaluation
def grade(plan: Plan, answers: dict[int, tuple[bool, Any]], missing: str) -> tuple[bool, str]:
    """(passed, why) of a planned check given the sandbox's answers; ``missing``: the reason for a
    step with no answer (the run ended before it)."""
    env = dict(plan.host_env)
    decided = 0
    for op in plan.host_ops:
        if op[0] == "assign":
            try:
                env[op[1]] = _eval(op[2], env, {})
            except Exception as e:  # noqa: BLE001 - the check's own statement raised: as in Python, the case fails
                return False, f"{type(e).__name__} in the check's own {op[1]} = ...: {_clean(str(e))}"
            continue
        _, upto, test, source = op
        for i in range(decided, upto):  # the steps before this assert ran (a statement that raised fails the check)
            if i not in answers:
                return False, f"{missing} (step {plan.steps[i].source!r:.100})"
            ok, v = answers[i]
            if not ok:
                return False, f"{plan.steps[i].source[:100]}: {v}"
        decided = upto
        try:
            if op[0] == "call":
                if not _call_matches(answers[upto - 1][1], test):
                    return False, f"wrong value of {source}"
                continue
            if not _eval(test, env, answers):
                return False, f"assertion failed: {source[:200]}"
        except CheckFailed as e:
            return False, str(e)
        except Exception as e:  # noqa: BLE001 - the check's own evaluation raised on the claimed values (TypeError, ...)
            return False, f"{type(e).__name__} evaluating {source[:150]!r}: {_clean(str(e))}"
    return True, ""


def _eval(node: ast.AST, env: dict, answers: dict) -> Any:
    ev = functools.partial(_eval, env=env, answers=answers)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        if node.id in HOST_BUILTINS:
            return HOST_BUILTINS[node.id]
        raise CheckFailed(f"name {node.id!r} is not known to the grader")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_hole":
        i = node.args[0].value
        if i not in answers:
            raise CheckFailed("no answer for a part of the check (the run ended before it)")
        ok, v = answers[i]
        if not ok:
            raise CheckFailed(str(v))
        return v
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [ev(e) for e in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        return {ev(k): ev(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](ev(node.operand))
    if isinstance(node, ast.BinOp):
        return _binop(node.op, ev(node.left), ev(node.right))
    if isinstance(node, ast.BoolOp):
        value = None
        for v in node.values:
            value = ev(v)
            if isinstance(node.op, ast.And) != bool(value):
                return value
        return value
    if isinstance(node, ast.Compare):
        left = ev(node.left)
        for op, comp in zip(node.ops, node.comparators):
            right = ev(comp)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return ev(node.body) if ev(node.test) else ev(node.orelse)
    if isinstance(node, ast.Subscript):
        return ev(node.value)[ev(node.slice)]
    if isinstance(node, ast.Slice):
        return slice(*(ev(p) if p is not None else None for p in (node.lower, node.upper, node.step)))
    if isinstance(node, ast.Attribute):
        base = ev(node.value)
        if base is _MATH:
            return getattr(_MATH, node.attr)
        if node.attr in HOST_METHODS.get(type(base), ()):
            return getattr(base, node.attr)
        raise CheckFailed(f"{type(base).__name__}.{node.attr} is not something the grader evaluates")
    if isinstance(node, ast.Call):
        fn = ev(node.func)  # a name, math.<name> or a plain value's method: what _eval hands out is all there is
        if not callable(fn):
            raise CheckFailed(f"{ast.unparse(node.func)} is not a function the grader calls")
        return fn(*[ev(a) for a in node.args], **{k.arg: ev(k.value) for k in node.keywords})
    raise CheckFailed(f"a {type(node).__name__} the grader does not evaluate")


def _call_matches(value: Any, expected: Any) -> bool:
    """A call-based case's comparison, as verl's prime-code grader (APPS): a tuple counts as a list,
    and a one-item list output also matches its item (APPS wraps many outputs in a list)."""
    if isinstance(value, tuple):
        value = list(value)
    if value == expected:
        return True
    return isinstance(expected, list) and len(expected) > 0 and value == expected[0]


def _bounded(n: Any, what: str) -> None:
    if n > MAX_ITEMS:
        raise CheckFailed(f"{what} would hold {n} items, over the grader's bound {MAX_ITEMS}")


def _binop(op: ast.operator, a: Any, b: Any) -> Any:
    if isinstance(op, ast.Mult):
        for seq, n in ((a, b), (b, a)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                _bounded(len(seq) * max(n, 0), "a repeated sequence")
    if isinstance(op, ast.Pow) and isinstance(a, int) and isinstance(b, int) and b > 0:
        _bounded(max(a.bit_length(), 1) * b // 10, "a power (bits / 10)")
    if isinstance(op, ast.LShift) and isinstance(b, int):
        _bounded(b // 10, "a shift (bits / 10)")
    return _BINARY[type(op)](a, b)


_UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift,
           ast.RShift: operator.rshift, ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
            ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
