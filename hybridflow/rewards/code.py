"""Code-execution reward: run the program in a response against test cases, in the sandbox.

The score is the fraction of test cases passed. A test case is either
- stdin/stdout: ``{"input": "<stdin>", "output": "<expected stdout>"}``; it passes when the program
  exits 0 within the limits and its stdout equals the expected one up to trailing whitespace on
  each line and trailing blank lines (compared here, on the host); or
- call-based (APPS / TACO ``{"fn_name": ..., "inputs": [[args], ...], "outputs": [...]}``): the
  function (or ``Solution().<fn_name>``) is called with each input list and its value compared
  here with the output, as verl's prime-code grader does (a tuple counts as a list; a one-item list
  output also matches its item); or
- assert-style: a string of Python (``"assert add(1, 2) == 3"``, MBPP / HumanEval style). It is
  graded **out of the solution's reach**: the sandbox gets only the parts of the check that call
  the solution's code (``code_checks.py``), answers with their values as plain data
  (``code_eval_harness.py``), and the check's own values and the comparison stay here (``code_host.py``). A check of a
  shape that cannot be split that way (a loop, ``try``, ...) runs inside the solution's process
  through ``code_harness.py`` as before: its result says ``inprocess=True``, it is counted in
  ``reward/code_inprocess_checks``, and ``strict`` grading fails it instead.

Deadline: under ``custom_reward_function.timeout_s`` each sandbox run's wall time is bounded by what is
left of the sample's deadline (``deadline.py``): at the deadline the sandbox kills the run (its cgroup
and pid namespace, every process of it) and no further test case starts; the sample is a timeout.

``ground_truth`` may be a list of test cases, one test case, the APPS / verl "prime code" dict
``{"inputs": [...], "outputs": [...]}`` (with ``fn_name``: call-based), or any of those as a JSON
string (as they sit in parquet files). Each test case is its own sandbox run, so one that hangs
costs only itself. Selected by ``data_source="code"`` in the default dispatcher
(``hybridflow.rewards.scorers.compute_score``; ``custom_reward_function.code_strict`` sets strict).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.agent.sandbox import SandboxLimits, SandboxResult, run_python
from hybridflow.rewards import deadline
from hybridflow.rewards.code_checks import NotGradable, Plan, Step, plan_check
from hybridflow.rewards.code_host import grade, parse_answers

_PY_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.S | re.I)
_ANY_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.S)

# Graded programs are small: tighter than the sandbox defaults so a batch of hanging answers stays cheap.
DEFAULT_LIMITS = SandboxLimits(cpu_s=4, wall_s=6, memory_mb=512, output_bytes=64 * 1024)
_HARNESS = (Path(__file__).with_name("code_harness.py")).read_text()  # in-process grading (checks that do not fit)
_EVAL_HARNESS = (Path(__file__).with_name("code_eval_harness.py")).read_text()  # out-of-process grading
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class CodeTest:
    stdin: str = ""
    expected: str | None = None  # stdout to match; None for an assert-style or call-based case
    check: str | None = None  # Python run after the program (assert-style)
    fn_name: str | None = None  # call-based: the function called with `args`, its value compared with `output`
    args: tuple = ()
    output: Any = None


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
            return _call_cases(gt)
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


def _call_cases(gt: dict) -> list[CodeTest]:
    fn, inputs, outputs = gt["fn_name"], gt.get("inputs"), gt.get("outputs")
    if not isinstance(fn, str) or not _IDENTIFIER.fullmatch(fn):
        raise ValueError(f"fn_name must be a Python identifier, got {fn!r:.100}")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise ValueError("call-based test cases need 'inputs' and 'outputs', lists of the same non-zero length")
    return [CodeTest(fn_name=fn, args=tuple(a) if isinstance(a, list) else (a,), output=o) for a, o in zip(inputs, outputs)]


def _text(x: Any) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def _normalize(out: str) -> str:
    return "\n".join(line.rstrip() for line in out.strip("\n").splitlines()).rstrip()


@dataclass(frozen=True)
class CaseResult:
    passed: bool
    why: str = ""  # for a failed case: what happened (assertion, crash, limit, no verdict)
    inprocess: bool = False  # graded inside the solution's process (a check that does not fit; see the module docstring)


def run_test_case(code: str, case: CodeTest, limits: SandboxLimits | None = None, strict: bool = False) -> CaseResult:
    """Run one test case in its own sandbox (a hanging case costs only itself). ``strict``: an
    assert-style check that cannot be graded out of the solution's reach fails instead of running in-process."""
    limits = limits or DEFAULT_LIMITS
    if case.fn_name is not None:
        return _run_plan(code, _call_plan(case), limits)
    if case.check is not None:
        try:
            plan = plan_check(case.check)
        except NotGradable as e:
            if strict:
                return CaseResult(False, f"strict grading: {e}", inprocess=True)
            result = _run_checks(code, [case.check], limits)[0]
            return CaseResult(result.passed, result.why, inprocess=True)
        return _run_plan(code, plan, limits)
    res = _sandboxed(code, limits, case.stdin)
    if not res.ok:
        return CaseResult(False, res.killed_reason or f"exit code {res.exit_code}")
    if _normalize(res.stdout) != _normalize(case.expected or ""):
        return CaseResult(False, "wrong output")
    return CaseResult(True)


def _run_plan(code: str, plan: Plan, limits: SandboxLimits) -> CaseResult:
    """A planned check: the sandbox evaluates the steps, this process decides (code_host.grade)."""
    job = json.dumps({"solution": code, "steps": [[s.kind, s.source] for s in plan.steps]})
    res = _sandboxed(_EVAL_HARNESS, limits, job)
    answers = parse_answers(res.stdout, plan.steps)
    missing = res.killed_reason or "no answer: the program ended the harness before this step"
    passed, why = grade(plan, answers, missing)
    return CaseResult(passed, why)


def _sandboxed(program: str, limits: SandboxLimits, stdin: str) -> SandboxResult:
    """One sandbox run; under a sample deadline (``deadline.current()``) its wall time ends there, and a
    run that the deadline cut (or one it leaves no time for) raises DeadlinePassed instead of failing a case."""
    d = deadline.current()
    if d is None:
        return run_python(program, limits, stdin=stdin)
    with d.running():  # counted before the time left is read: the manager waits for this run's kill, or it never starts
        left = d.left()
        if left <= 0:
            raise deadline.DeadlinePassed("the sample's reward deadline passed before this test case started")
        res = run_python(program, dataclasses.replace(limits, wall_s=min(limits.wall_s, left)), stdin=stdin)
    if d.left() <= 0:
        raise deadline.DeadlinePassed("the sample's reward deadline passed during a test case")
    return res


def _call_plan(case: CodeTest) -> Plan:
    """A call-based case as a plan: one hole, ``fn(*args)`` (or ``Solution().fn(*args)``), and the
    comparison of verl's prime-code grader on the host."""
    args = repr(list(case.args))
    fn = case.fn_name
    source = f"(Solution().{fn} if 'Solution' in globals() and hasattr(Solution, {fn!r}) else {fn})(*{args})"
    return Plan(steps=[Step("eval", source)], host_ops=[("call", 1, case.output, f"{fn}(*{args[:100]})")])


def _run_checks(code: str, checks: list[str], limits: SandboxLimits) -> list[CaseResult]:
    """Assert-style checks through the in-process grading harness; a check without a verdict failed."""
    sentinel = secrets.token_hex(16)
    job = json.dumps({"solution": code, "checks": checks})
    res = _sandboxed(_HARNESS, limits, f"{sentinel}\n{job}")
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


def code_case_results(solution_str: str, ground_truth: Any, limits: SandboxLimits | None = None,
                      strict: bool = False) -> list[CaseResult]:
    """Each test case's result for the response's program, in the order of ``ground_truth``."""
    cases = parse_test_cases(ground_truth)
    code = extract_code(solution_str)
    return [run_test_case(code, c, limits, strict) for c in cases]


def code_score(solution_str: str, ground_truth: Any, limits: SandboxLimits | None = None, strict: bool = False) -> float:
    """Fraction of the test cases that the response's program passes."""
    results = code_case_results(solution_str, ground_truth, limits, strict)
    return sum(r.passed for r in results) / len(results)


def code_reward(solution_str: str, ground_truth: Any, strict: bool = False) -> dict:
    """The reward manager's view: ``score`` and ``code_inprocess_checks`` (checks graded, or under
    ``strict`` refused, inside the solution's process; summed into ``reward/code_inprocess_checks``)."""
    results = code_case_results(solution_str, ground_truth, strict=strict)
    return {"score": sum(r.passed for r in results) / len(results),
            "code_inprocess_checks": float(sum(r.inprocess for r in results))}


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl-style entry point (usable as ``custom_reward_function.path``)."""
    return code_score(solution_str, ground_truth)
