"""Code-execution reward: run the program in a response against test cases, in the sandbox.

The score is the fraction of test cases passed. A test case is either
- stdin/stdout: ``{"input": "<stdin>", "output": "<expected stdout>"}``; it passes when the program
  exits 0 within the limits and its stdout equals the expected one up to trailing whitespace on
  each line and trailing blank lines; or
- assert-style: a string of Python (``"assert add(1, 2) == 3"``) run after the program; it passes
  when the grading harness (``code_harness.py``) reports it passed. The harness, not the program's
  exit status, decides: a program that exits early (``raise SystemExit(0)``, ``os._exit(0)``,
  ``atexit.register(os._exit, 0)``) cannot make a check pass that its code fails.

``ground_truth`` may be a list of test cases, one test case, the APPS / verl "prime code" dict
``{"inputs": [...], "outputs": [...]}`` (call-based ``fn_name`` tests are not supported), or any of
those as a JSON string (as they sit in parquet files). Each test case is its own sandbox run, so
one that hangs costs only itself. Selected by ``data_source="code"`` in the default dispatcher
(``hybridflow.rewards.scorers.compute_score``).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.agent.sandbox import SandboxLimits, run_python

_PY_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.S | re.I)
_ANY_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.S)

# Graded programs are small: tighter than the sandbox defaults so a batch of hanging answers stays cheap.
DEFAULT_LIMITS = SandboxLimits(cpu_s=4, wall_s=6, memory_mb=512, output_bytes=64 * 1024)
_HARNESS = (Path(__file__).with_name("code_harness.py")).read_text()


@dataclass(frozen=True)
class CodeTest:
    stdin: str = ""
    expected: str | None = None  # stdout to match; None for an assert-style case
    check: str | None = None  # Python run after the program (assert-style)


def extract_code(response: str) -> str:
    """The last ```python block, else the last fenced block, else the whole response."""
    for pattern in (_PY_FENCE, _ANY_FENCE):
        blocks = pattern.findall(response or "")
        if blocks:
            return blocks[-1]
    return response or ""


def parse_test_cases(ground_truth: Any) -> list[CodeTest]:
    """Test cases from the formats listed in the module docstring; ValueError for anything else."""
    gt = ground_truth
    if isinstance(gt, str):
        try:
            gt = json.loads(gt)
        except json.JSONDecodeError:
            return [CodeTest(check=gt)]  # plain Python: one assert-style case
    if isinstance(gt, dict):
        if "fn_name" in gt:
            raise ValueError("call-based test cases (fn_name) are not supported; use stdin/stdout or assert strings")
        if "inputs" in gt and "outputs" in gt:
            if len(gt["inputs"]) != len(gt["outputs"]):
                raise ValueError(f"{len(gt['inputs'])} inputs but {len(gt['outputs'])} outputs")
            gt = [{"input": i, "output": o} for i, o in zip(gt["inputs"], gt["outputs"])]
        else:
            gt = [gt]
    if isinstance(gt, str):
        gt = [gt]
    if not isinstance(gt, (list, tuple)):
        raise ValueError(f"test cases must be a list, a dict or a JSON string, got {type(gt).__name__}")
    cases = []
    for t in gt:
        if isinstance(t, str):
            cases.append(CodeTest(check=t))
        elif isinstance(t, dict) and "output" in t:
            cases.append(CodeTest(stdin=_text(t.get("input", "")), expected=_text(t["output"])))
        else:
            raise ValueError(f"a test case is an assert string or a dict with 'input' and 'output', got {t!r:.200}")
    if not cases:
        raise ValueError("no test cases")
    return cases


def _text(x: Any) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def _normalize(out: str) -> str:
    return "\n".join(line.rstrip() for line in out.strip("\n").splitlines()).rstrip()


@dataclass(frozen=True)
class CaseResult:
    passed: bool
    why: str = ""  # for a failed case: what happened (assertion, crash, limit, no verdict)


def run_test_case(code: str, case: CodeTest, limits: SandboxLimits | None = None) -> CaseResult:
    """Run one test case in its own sandbox (a hanging case costs only itself)."""
    limits = limits or DEFAULT_LIMITS
    if case.check is not None:
        return _run_checks(code, [case.check], limits)[0]
    res = run_python(code, limits, stdin=case.stdin)
    if not res.ok:
        return CaseResult(False, res.killed_reason or f"exit code {res.exit_code}")
    if _normalize(res.stdout) != _normalize(case.expected or ""):
        return CaseResult(False, "wrong output")
    return CaseResult(True)


def _run_checks(code: str, checks: list[str], limits: SandboxLimits) -> list[CaseResult]:
    """Assert-style checks through the grading harness; a check without a verdict failed."""
    sentinel = secrets.token_hex(16)
    job = json.dumps({"solution": code, "checks": checks})
    res = run_python(_HARNESS, limits, stdin=f"{sentinel}\n{job}")
    verdicts: dict[int, CaseResult] = {}
    for line in res.stdout.splitlines():
        if line.startswith(sentinel + " "):
            for v in json.loads(line[len(sentinel) + 1:]):
                verdicts[int(v["case"])] = CaseResult(bool(v["ok"]), str(v.get("why", "")))
    if res.killed_reason and not verdicts:
        missing = CaseResult(False, res.killed_reason)
    else:
        missing = CaseResult(False, "no verdict: the program ended the grader before this check ran")
    return [verdicts.get(i, missing) for i in range(len(checks))]


def code_case_results(solution_str: str, ground_truth: Any, limits: SandboxLimits | None = None) -> list[CaseResult]:
    """Each test case's result for the response's program, in the order of ``ground_truth``."""
    cases = parse_test_cases(ground_truth)
    code = extract_code(solution_str)
    return [run_test_case(code, c, limits) for c in cases]


def code_score(solution_str: str, ground_truth: Any, limits: SandboxLimits | None = None) -> float:
    """Fraction of the test cases that the response's program passes."""
    results = code_case_results(solution_str, ground_truth, limits)
    return sum(r.passed for r in results) / len(results)


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl-style entry point (usable as ``custom_reward_function.path``)."""
    return code_score(solution_str, ground_truth)
