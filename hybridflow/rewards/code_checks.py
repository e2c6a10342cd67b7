"""Assert-style checks graded outside the solution's process: the plan (what the sandbox runs).

Why: a solution that runs in the grader's process can reach the grader (its frames, the verdict
pipe, the standard library it reports with) and can return objects whose ``__eq__`` is always
true. So the host never lets the solution see the expected side of a check or decide a verdict:

1. :func:`plan_check` (here) parses a check (``assert f(1) == 2``; ``assert abs(f(x) - 0.5) < 1e-6``;
   ``assert isinstance(f(x), int)``; several statements; HumanEval's ``def check(candidate)`` +
   ``check(fn)``; see docs/agents.md) into *steps* for the sandbox: statements to run and
   expressions to evaluate (the "holes"), and, per ``assert``, a tree for the host to evaluate.
2. A hole is a largest part of an assert that uses the solution's names and holds none of the
   check's own values (no constant, no name of the check's, except as an argument of a call to
   the solution's code: those are the inputs). ``f(x) == 3`` sends ``f(x)``;
   ``abs(f(3.5) - 0.5) < 1e-6`` sends ``f(3.5)``; ``str(Node(1)) == "1"`` sends ``str(Node(1))``;
   ``isinstance`` and ``type`` always run here. Whatever a hole evaluates to is the solution's
   *claim* about its own code: no more than a function returning that value could claim.
3. The sandbox (``code_eval_harness.py``) answers each step with a value as plain data, and
   ``code_host.py`` rebuilds the values and evaluates the rest of each assert with the check's own
   values.

A check that does not fit (loops, ``try``, comprehensions around the solution's calls, ...) raises
:class:`NotGradable`: the caller grades it in-process (``code_harness.py``) and counts it, or
refuses it under strict grading.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from typing import Any

from hybridflow.rewards.code_host import (ALL_HOST_METHODS, FOREIGN_MODULES, HOST_BUILTINS, MATH, MATH_NAMES,
                                          PREDICATE_METHODS)


class NotGradable(ValueError):
    """The check has a shape this module cannot grade outside the solution's process."""


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


_ALWAYS_HOST_CALLS = {"isinstance", "type"}  # their answer is about the value's type: never the solution's to give


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
                env[a.asname or "math"] = MATH
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
    """Refuse, when planning, what ``code_host.grade`` would not evaluate (comprehensions, lambdas, ...)."""
    for n in ast.walk(node):
        if not isinstance(n, _SUPPORTED):
            raise NotGradable(f"a {type(n).__name__} in the check's own values ({ast.unparse(node)!r})")
        if isinstance(n, ast.Attribute) and not isinstance(n.value, ast.Name) and n.attr not in ALL_HOST_METHODS:
            raise NotGradable(f"attribute {n.attr!r} in the check's own values")
