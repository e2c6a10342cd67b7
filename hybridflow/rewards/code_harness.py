"""The in-process grading harness: run in the sandbox as ``main.py``, never imported. Since the
out-of-process grader (``code_checks.py`` + ``code_eval_harness.py``) it grades only the checks
that grader cannot split (loops, ``try``, ...): each such case is marked ``inprocess``, counted in
``reward/code_inprocess_checks`` and refused under ``custom_reward_function.code_strict``.

Why not "the program, then the asserts, pass if it exits 0": the program decides its own exit
status. ``raise SystemExit(0)`` before the asserts, ``os._exit(0)``, or
``atexit.register(os._exit, 0)`` made a wrong answer pass (the classic reward hack of code RL).

Protocol (stdin, a memfd the host wrote): one line with a per-run random sentinel, then JSON
``{"solution": str, "checks": [str, ...]}``. The harness
1. reads the sentinel into a bytearray (no other copy), replaces stdin with /dev/null and makes
   itself non-dumpable (so its /proc files are not the solution's to read);
2. forks the *grader*, which zeroes its copy of the sentinel, sends its stdout to /dev/null (the
   verdict line is the harness's alone), runs the solution as ``__main__`` with ``SystemExit``
   caught and ``os._exit`` turned into an exception, then each check, each under its own
   ``BaseException`` handler, and writes one verdict per check on a pipe as soon as it has it;
3. after the grader ends (however it ends), prints ``<sentinel> <json verdicts>``.
The host passes a case only on that line with its verdict: a program that ends the grader early
leaves its remaining checks without a verdict, and one that prints its own line cannot know the
sentinel. What it does not stop: a solution that inspects and rewrites the grader in-process
(frames, monkeypatched builtins, objects whose ``__eq__`` is always true, pass lines on the verdict
pipe before it kills itself: tests/test_code_redteam.py shows each); docs/agents.md (threat model)
says so.
"""

import json
import os
import sys

SENTINEL_BYTES = 32  # hex digits, then "\n"


class SolutionExit(BaseException):
    """os._exit called by the solution: ends the solution's code, not the grader."""


def grade(solution, checks, out_fd):
    real_exit = os._exit

    def no_exit(code=0):
        raise SolutionExit(code)

    os._exit = no_exit
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    load_error = None
    try:
        exec(compile(solution, "solution.py", "exec"), ns)
    except (SystemExit, SolutionExit):
        pass  # a script that ends itself: its definitions stand, the checks still run
    except BaseException as e:  # noqa: BLE001 - reported as the verdict of every check
        load_error = f"the solution raised {type(e).__name__}: {e}"[:300]
    for i, check in enumerate(checks):
        if load_error is not None:
            verdict = {"case": i, "ok": False, "why": load_error}
        else:
            try:
                exec(compile(check, f"check_{i}.py", "exec"), ns)
                verdict = {"case": i, "ok": True}
            except AssertionError as e:
                verdict = {"case": i, "ok": False, "why": f"assertion failed: {e}"[:300]}
            except BaseException as e:  # noqa: BLE001 - SystemExit and os._exit inside a check fail it too
                verdict = {"case": i, "ok": False, "why": f"{type(e).__name__}: {e}"[:300]}
        os.write(out_fd, (json.dumps(verdict) + "\n").encode())
    real_exit(0)


def main():
    sentinel = bytearray(SENTINEL_BYTES + 1)
    got = 0
    while got < len(sentinel):
        n = os.readv(0, [memoryview(sentinel)[got:]])
        if n == 0:
            break
        got += n
    payload = b""
    while chunk := os.read(0, 1 << 20):
        payload += chunk
    job = json.loads(payload)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    import ctypes

    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        sentinel[:] = bytes(len(sentinel))
        os.close(r)
        sys.stdout.flush()
        os.dup2(null, 1)
        grade(job["solution"], job["checks"], w)
    os.close(w)
    verdicts = []
    buf = b""
    while chunk := os.read(r, 65536):
        buf += chunk
    os.waitpid(pid, 0)
    for line in buf.decode(errors="replace").splitlines():
        try:
            verdicts.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line: the grader died while writing it
    os.write(1, bytes(sentinel[:SENTINEL_BYTES]) + b" " + json.dumps(verdicts).encode() + b"\n")


main()
