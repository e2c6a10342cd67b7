"""The code reward's red team as a table: each forgery attempt of tests/test_code_redteam.py with its
wrong solution, scored by b4554a1's in-process harness (before) and by today's grading (after), and
the plain right solution's score today (it must stay 1.0).

Run:  .venv/bin/python bench/code_redteam.py [--backend bwrap|unshare]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from test_code_redteam import ATTEMPTS, RIGHT, old_score  # noqa: E402

from hybridflow.agent.sandbox import Sandbox, core  # noqa: E402
from hybridflow.rewards.code import code_score  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="bwrap" if shutil.which("bwrap") else "unshare")
    args = ap.parse_args()
    sb = Sandbox(backend=args.backend)
    core._DEFAULT = sb  # today's grading runs in the default sandbox
    print(f"backend: {args.backend}; wrong solutions' add subtracts")
    print("| # | attempt | before (b4554a1) | after | right solution after |")
    print("|---|---|---|---|---|")
    for n, a in enumerate(ATTEMPTS, 1):
        before = old_score(sb, a.solution, a.checks)
        after = code_score(a.solution, list(a.checks))
        right = code_score(RIGHT, list(a.checks))
        print(f"| {n} | {a.name} | {before:.1f} | {after:.1f} | {right:.1f} |", flush=True)


if __name__ == "__main__":
    main()
