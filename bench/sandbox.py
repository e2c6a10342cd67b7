"""What the sandbox's protections and the code reward's grading harness cost per run.

Rows, per backend installed here (median of ``--runs`` runs each, milliseconds of wall time):
- ``print(1)``: one sandbox run of a trivial program, with everything on (cgroup, seccomp, keyring,
  our init), and the same with ``cgroup="none"`` (rlimits only) beside it;
- an assert-style test case graded the naive way (the program with the assert appended, pass on
  exit 0: gameable by ``SystemExit(0)``), by b4554a1's in-process harness (kept as
  ``tests/fixtures/code_harness_b4554a1.py``; today's ``code_harness.py`` for checks that do not fit
  is the same program) and by today's out-of-process grading (``rewards/code_checks.py`` +
  ``code_eval_harness.py``): the differences to the naive run are what each harness adds per case.

Run:  .venv/bin/python bench/sandbox.py [--runs 20]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import time

from hybridflow.agent.sandbox import Sandbox, core
from hybridflow.rewards.code import DEFAULT_LIMITS, CodeTest, run_test_case

SOLUTION = "def add(a, b):\n    return a + b\n"
CHECK = "assert add(1, 2) == 3"
OLD_HARNESS = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures",
                                "code_harness_b4554a1.py")).read()


def old_case(sb: Sandbox) -> bool:
    """One case through b4554a1's harness, as b4554a1 ran it (rewards/code.py _run_checks there)."""
    sentinel = secrets.token_hex(16)
    res = sb.run_python(OLD_HARNESS, DEFAULT_LIMITS, stdin=f"{sentinel}\n" + json.dumps({"solution": SOLUTION, "checks": [CHECK]}))
    return any(line.startswith(sentinel + " ") and json.loads(line[33:])[0]["ok"] for line in res.stdout.splitlines())


def median_ms(fn, runs: int) -> float:
    fn()  # warm the page cache
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    backends = [b for b in ("bwrap", "unshare") if b != "bwrap" or shutil.which("bwrap")]
    print("| backend | print(1), all on | print(1), no cgroup | case, exit-0 grading | case, b4554a1 harness | "
          "case, out of process | b4554a1 harness adds | out of process adds |")
    print("|---|---|---|---|---|---|---|---|")
    for backend in backends:
        sb = Sandbox(backend=backend)
        bare = Sandbox(backend=backend, cgroup="none")
        core._DEFAULT = sb  # run_test_case grades in the default sandbox
        trivial = median_ms(lambda: sb.run_python("print(1)"), args.runs)
        trivial_bare = median_ms(lambda: bare.run_python("print(1)"), args.runs)
        old = median_ms(lambda: sb.run_python(f"{SOLUTION}\n{CHECK}\n", DEFAULT_LIMITS), args.runs)
        before = median_ms(lambda: old_case(sb), args.runs)
        new = median_ms(lambda: run_test_case(SOLUTION, CodeTest(check=CHECK)), args.runs)
        assert run_test_case(SOLUTION, CodeTest(check=CHECK)).passed and old_case(sb)
        print(f"| {backend} ({sb.enforcement.cgroup or 'no cgroup'}) | {trivial:.0f} ms | {trivial_bare:.0f} ms | "
              f"{old:.0f} ms | {before:.0f} ms | {new:.0f} ms | {before - old:+.0f} ms | {new - old:+.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
