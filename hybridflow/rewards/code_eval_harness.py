"""The sandbox side of out-of-process grading: run as ``main.py`` in the sandbox, never imported.

It holds no expected value and decides no verdict: it runs the solution, then the steps the host
planned (``code_checks.plan_check``: statements, and expressions that use the solution's code)
and writes one answer line per step on its standard output, ``{"i": step, "v": <value>}`` or
``{"i": step, "err": "<why>"}``. The host compares the values with the check's own values, which
never enter the sandbox. Everything here runs in the solution's process, so the solution can
change any of it (the encoder, the answers, this loop): each answer is only its claim about what
its code computes, and the host reads each step's answer once (a second one fails the step).

Protocol: stdin, JSON ``{"solution": str, "steps": [["exec" | "eval", source], ...]}``.
Values are encoded as plain data only (``encode``): anything else is an error answer.
"""

import json
import os

MAX_DEPTH = 100


class SolutionExit(BaseException):
    """os._exit called by the solution: ends the solution's code, not the harness."""


def encode(v, depth=0):
    """A value as tagged JSON with exact built-in types (a subclass of int is sent as the int it holds)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    t = type(v)
    if v is None or t is bool or t is str:
        return v
    if t is int:
        return {"int": str(v)}
    if t is float:
        return {"float": repr(v)}
    if t is complex:
        return {"complex": [repr(v.real), repr(v.imag)]}
    if t is bytes:
        return {"bytes": v.hex()}
    if t is list:
        return [encode(x, depth + 1) for x in v]
    if t in (tuple, set, frozenset):
        return {t.__name__: [encode(x, depth + 1) for x in v]}
    if t is dict:
        return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]}
    # A subclass of a plain type (Counter, OrderedDict, namedtuple, IntEnum, ...) crosses as its base
    # type's value: whatever its __eq__ says, the host compares the plain value.
    for base in (int, float, complex, str, bytes, list, tuple, dict, set, frozenset):
        if isinstance(v, base):
            return encode(base(v), depth + 1)
    raise TypeError(f"a {t.__module__}.{t.__qualname__} is not plain data (None, bool, int, float, complex, str, "
                    "bytes, list, tuple, dict, set, frozenset)")


def describe(e):
    """An exception as text, without calling the solution's __str__ (it may lie or raise)."""
    t = type(e)
    try:
        args = e.args if type(e.args) is tuple else ()
        msg = ", ".join(a if type(a) is str else repr(a) if type(a) in (int, float, bool) else "..." for a in args)
    except BaseException:  # noqa: BLE001
        msg = "..."
    return f"{t.__name__}: {msg}"[:300]


def main():
    payload = b""
    while chunk := os.read(0, 1 << 20):
        payload += chunk
    job = json.loads(payload)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    out = os.dup(1)  # the answers; the solution's own prints go to /dev/null
    os.dup2(null, 1)
    write = os.write
    dumps = json.dumps

    def answer(i, **msg):
        write(out, (dumps({"i": i, **msg}) + "\n").encode())

    def no_exit(code=0):
        raise SolutionExit(code)

    real_exit = os._exit
    os._exit = no_exit
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(job["solution"], "solution.py", "exec"), ns)
    except (SystemExit, SolutionExit):
        pass  # a script that ends itself: its definitions stand
    except BaseException as e:  # noqa: BLE001 - every step fails with it
        for i in range(len(job["steps"])):
            answer(i, err=f"the solution raised {describe(e)}")
        real_exit(0)
    ns.setdefault("math", __import__("math"))  # checks use math without importing it (MBPP)
    for i, (kind, source) in enumerate(job["steps"]):
        try:
            if kind == "exec":
                exec(compile(source, f"step_{i}", "exec"), ns)
                answer(i)
            else:
                value = eval(compile(source, f"step_{i}", "eval"), ns)
                answer(i, v=encode(value))
        except (SystemExit, SolutionExit) as e:
            answer(i, err=f"{type(e).__name__} in {source[:100]!r}")
        except RecursionError:
            answer(i, err="RecursionError (nested too deep)")
        except BaseException as e:  # noqa: BLE001 - the step failed; later steps still run
            answer(i, err=describe(e))
    real_exit(0)  # no atexit handlers, finalizers or waiting for the solution's threads


main()
