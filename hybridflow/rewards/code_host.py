"""The host's side of out-of-process grading: the values the sandbox answers with, and the
evaluation of each assert's own part with them (``code_checks.py`` makes the plan).

The host evaluates in a small interpreter over the check's syntax tree: literals, arithmetic with
size bounds, comparisons, a list of pure built-ins, ``math`` (without the functions whose cost grows
with an argument's value), and safe methods of plain values. The values it computes with come from
the sandbox as tagged plain data (``code_eval_harness.encode``), rebuilt here with exact built-in
types (:func:`decode_value`), each step's answer read once (:func:`parse_answers`).
"""

from __future__ import annotations

import ast
import builtins
import functools
import json
import math
import operator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.rewards.code_checks import Plan, Step

MAX_DEPTH = 100  # nesting of a value from the sandbox (lists in lists ...)
MAX_ITEMS = 1_000_000  # elements a host-side operation may create (sequence * n, range, ...)


class CheckFailed(Exception):
    """An assert evaluated to false or could not be evaluated here; the message says why."""


# ---------------------------------------------------------------------- what the host evaluates with
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


class _MathModule:
    """``math`` as the check's namespace sees it on the host (only MATH_NAMES)."""

    def __getattr__(self, name):
        if name in MATH_NAMES:
            return MATH_NAMES[name]
        raise CheckFailed(f"math.{name} is not available to the grader")


MATH = _MathModule()
HOST_BUILTINS["math"] = MATH
# Modules a check may call on its own values (np.allclose(f(x), 5)): such a call is neither the
# solution's code nor the grader's, so the check is graded in-process, not sent as a hole.
FOREIGN_MODULES = {"np", "numpy", "re", "heapq", "collections", "itertools", "functools", "operator", "string",
                   "random", "sys", "os", "cmath", "statistics", "fractions", "decimal", "json", "copy", "bisect"}




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
        if base is MATH:
            return getattr(MATH, node.attr)
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
