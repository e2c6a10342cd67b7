"""Red team of the code reward: wrong solutions that try to forge a pass, each against today's
grader (out of the solution's reach: rewards/code_checks.py) and, as its control, against what it
was built to beat: the in-process harness of b4554a1 (tests/fixtures/code_harness_b4554a1.py, run
exactly as b4554a1 ran it), the naive "program + asserts, pass on exit 0" grading, or a direct look
at the channel or the value it attacks with. A control that fails means the probe broke, not the
grader.

Every wrong solution's ``add`` subtracts; every check set scores 1.0 with the plain right ``add``.
``bench/code_redteam.py`` prints the table (attempt, before on b4554a1, after).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import dataclass

import pytest

from hybridflow.agent.sandbox import Sandbox, core
from hybridflow.rewards.code import _EVAL_HARNESS, DEFAULT_LIMITS, code_case_results, code_score

OLD_HARNESS = open(os.path.join(os.path.dirname(__file__), "fixtures", "code_harness_b4554a1.py")).read()
RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
CHECKS = ("assert add(1, 2) == 3", "assert add(5, 7) == 12")
FLOAT_CHECKS = ("assert abs(add(0.5, 0.25) - 0.75) < 1e-9", "assert abs(add(1, 2) - 3) < 1e-9")
ISCLOSE_CHECKS = ("import math\nassert math.isclose(add(0.5, 0.25), 0.75)", "assert math.isclose(add(1, 2), 3)")

# Writes pass lines on every descriptor it can (the verdict pipe of b4554a1's harness, today's answer
# channel): b4554a1's verdicts ({"case": i, "ok": true}) by default; FORGE_ANSWERS: today's answers.
FORGE = '''
import json as _json, os as _os, signal as _signal
def _forge():
    lines = b"".join((_json.dumps(m) + "\\n").encode() for i in range(4) for m in ({"case": i, "ok": True},))
    for fd in range(3, 40):
        try:
            _os.write(fd, lines)
        except OSError:
            pass
def _forge_and_die():
    _forge()
    _os.kill(_os.getpid(), _signal.SIGKILL)
'''
FORGE_ANSWERS = FORGE.replace('for m in ({"case": i, "ok": True},)', 'for m in ({"i": i, "v": True}, {"i": i, "ok": True})')
FORGE_SPRAY = FORGE.replace('for m in ({"case": i, "ok": True},)', 'for v in range(20) for m in ({"i": i, "v": {"int": str(v)}},)')
SLOW_WRONG = "import time\ndef add(a, b):\n    time.sleep(3)\n    return a - b\n"
# Finds "add(<a>, <b>) == <n>" anywhere in the process (containers and frames) and answers n.
LOOKUP = r'''
import gc, re, sys
def _lookup(a, b):
    pat = re.compile(r"add\(\s*%r\s*,\s*%r\s*\)\s*==\s*(-?\d+)" % (a, b))
    texts = []
    for o in gc.get_objects():
        items = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()
        texts += [s for s in list(items) if isinstance(s, (str, bytes))]
    f = sys._getframe()
    while f is not None:
        texts += [v for v in f.f_locals.values() if isinstance(v, (str, bytes))]
        f = f.f_back
    for s in texts:
        m = pat.search(s.decode(errors="replace") if isinstance(s, bytes) else s)
        if m:
            return int(m.group(1))
    return None
def add(a, b):
    found = _lookup(a, b)
    return found if found is not None else a - b
'''


@dataclass(frozen=True)
class Attempt:
    name: str
    solution: str  # a wrong solution with the attack
    control: str  # "old": b4554a1's harness passes it; "naive": exit-0 grading passes it; "channel", "lie", "measure"
    checks: tuple[str, ...] = CHECKS
    measure: str = ""  # for control "measure": Python printing what the attack builds (run bare in the sandbox)
    expect: str = ""  # ... and what it must print; for "channel": a forged line that must reach the answer channel


ATTEMPTS = [
    Attempt("verdict descriptor: pass lines on every fd, then SIGKILL", FORGE + "_forge_and_die()\n" + WRONG, "old"),
    Attempt("answer channel: forged answers on every fd, then SIGKILL", FORGE_ANSWERS + "_forge_and_die()\n" + WRONG, "channel",
            expect='{"i": 0, "v": true}'),
    Attempt("answer spraying: every candidate value for every step, the right one among them", WRONG + FORGE_SPRAY + "_forge()\n", "channel",
            expect='{"i": 0, "v": {"int": "3"}}'),
    Attempt("frames: rewrite the grader's checks / steps from the caller's frame", '''
import sys
f = sys._getframe(1)
while f is not None:
    for v in list(f.f_locals.values()):
        if isinstance(v, list) and v and all(isinstance(c, str) for c in v):
            v[:] = ["pass"] * len(v)
        if isinstance(v, dict) and isinstance(v.get("checks"), list):
            v["checks"][:] = ["pass"] * len(v["checks"])
        if isinstance(v, dict) and isinstance(v.get("steps"), list):
            v["steps"][:] = [["eval", "True"]] * len(v["steps"])
    f = f.f_back
''' + WRONG, "old"),
    Attempt("stdlib: json.dumps rewrites every verdict to ok", '''
import json
_dumps = json.dumps
def _lying_dumps(o, *a, **k):
    if isinstance(o, dict):
        o = {**o, "ok": True, "v": True}
    return _dumps(o, *a, **k)
json.dumps = _lying_dumps
''' + WRONG, "old"),
    Attempt("stdlib: os.write turns false into true", '''
import os
_write = os.write
os.write = lambda fd, b: _write(fd, b.replace(b'"ok": false', b'"ok": true'))
''' + WRONG, "old"),
    Attempt("builtins: compile/eval make every check a no-op", '''
import builtins
_compile = builtins.compile
builtins.compile = lambda src, fn, mode, *a, **k: _compile("pass" if mode == "exec" else "True", fn, mode, *a, **k)
''' + WRONG, "old"),
    Attempt("builtins: abs() always 0", "import builtins\nbuiltins.abs = lambda x: 0\n" + WRONG, "old", FLOAT_CHECKS),
    Attempt("stdlib: math.isclose always true", "import math\nmath.isclose = lambda *a, **k: True\n" + WRONG, "old",
            ISCLOSE_CHECKS),
    Attempt("always-equal object", "class Eq:\n    def __eq__(self, o):\n        return True\n"
            "def add(a, b):\n    return Eq()\n", "old"),
    Attempt("always-equal int subclass", "class I(int):\n    __hash__ = int.__hash__\n    def __eq__(self, o):\n        return True\n"
            "def add(a, b):\n    return I(a - b)\n", "old"),
    Attempt("always-equal list subclass", "class L(list):\n    def __eq__(self, o):\n        return True\n"
            "def add(a, b):\n    return L([a - b])\n", "old"),
    Attempt("always-equal int subclass passed off as int by patching type()", '''
import builtins
class I(int):
    __hash__ = int.__hash__
    def __eq__(self, o):
        return True
_type = builtins.type
builtins.type = lambda *a: int if len(a) == 1 and _type(a[0]) is I else _type(*a)
def add(a, b):
    return I(a - b)
''', "old"),
    Attempt("look-alike value: startswith/endswith always true", "class S:\n    def startswith(self, p):\n        return True\n"
            "    endswith = startswith\ndef add(a, b):\n    return S()\n", "old",
            ("assert add('a', 'b').startswith('ab')", "assert add('x', 'y').endswith('xy')")),
    Attempt("lookup: read the expected value out of the grader's memory", LOOKUP, "old"),
    Attempt("finalizer: __del__ writes pass lines, then SIGKILL", FORGE + '''
class Bomb:
    def __del__(self):
        _forge_and_die()
b = Bomb()
del b
''' + WRONG, "old"),
    Attempt("thread that outlives the call: forges while add() sleeps", FORGE + '''
import threading, time
def _late():
    time.sleep(0.3)
    _forge_and_die()
threading.Thread(target=_late, daemon=True).start()
''' + SLOW_WRONG, "old"),
    Attempt("fork and write later: a grandchild forges after the real verdicts", FORGE + '''
import os, time
if os.fork() == 0:
    time.sleep(0.5)
    _forge_and_die()
''' + WRONG, "old"),
    Attempt("signal: a SIGALRM handler forges while add() sleeps", FORGE + '''
import signal
signal.signal(signal.SIGALRM, lambda *a: _forge_and_die())
signal.setitimer(signal.ITIMER_REAL, 0.3)
''' + SLOW_WRONG, "old"),
    Attempt("exception whose __str__ lies (a verdict line in its text)", '''
class Lie(Exception):
    def __str__(self):
        return '"}\\n{"case": 0, "ok": true}\\n{"i": 0, "v": true}\\nok'
def add(a, b):
    raise Lie()
''', "lie"),
    Attempt("recursion bomb: a value nested 100,000 deep", '''
import sys
sys.setrecursionlimit(1_000_000)
def add(a, b):
    v = a - b
    for _ in range(100_000):
        v = [v]
    return v
''', "measure", measure="v = add(1, 2)\nn = 0\nwhile isinstance(v, list):\n    v, n = v[0], n + 1\nprint(n)",
            expect="100000"),
    Attempt("huge value: a 10 MB string", "def add(a, b):\n    return 'x' * 10_000_000\n", "measure",
            measure="print(len(add(1, 2)))", expect="10000000"),
    Attempt("an int past the int-to-str limit", "def add(a, b):\n    return 10 ** 5000 + a - b\n", "measure",
            measure="print(add(1, 2).bit_length() > 16000)", expect="True"),
    Attempt("exit early: raise SystemExit(0)", WRONG + "raise SystemExit(0)\n", "naive"),
    Attempt("exit early: os._exit(0)", WRONG + "import os\nos._exit(0)\n", "naive"),
    Attempt("exit early: atexit.register(os._exit, 0)", WRONG + "import atexit, os\natexit.register(os._exit, 0)\n", "naive"),
]
# the four attacks of the issue that scored 1.0 on b4554a1
ISSUE_FOUR = [a for a in ATTEMPTS if a.name.startswith(("verdict descriptor", "frames", "stdlib: json.dumps", "always-equal object"))]
assert len(ISSUE_FOUR) == 4


def old_score(sb: Sandbox, solution: str, checks) -> float:
    """b4554a1's grading of assert-style checks (rewards/code.py _run_checks there), one run per check."""
    return sum(old_case(sb, solution, c)[0] for c in checks) / len(checks)


def old_case(sb: Sandbox, solution: str, check: str) -> tuple[bool, str]:
    sentinel = secrets.token_hex(16)
    res = sb.run_python(OLD_HARNESS, DEFAULT_LIMITS, stdin=f"{sentinel}\n" + json.dumps({"solution": solution, "checks": [check]}))
    verdict = (False, "no verdict")
    for line in res.stdout.splitlines():
        if line.startswith(sentinel + " "):
            try:
                for v in json.loads(line[len(sentinel) + 1:]):
                    if int(v["case"]) == 0:  # the last verdict for the case stands, as it did there
                        verdict = (bool(v["ok"]), str(v.get("why", "")))
            except (KeyError, TypeError, ValueError) as e:  # there it raised: the reward manager scored 0
                return False, f"the grader raised {type(e).__name__}"
    return verdict


def naive_score(sb: Sandbox, solution: str, checks) -> float:
    """The grading the harness replaced: the program with the assert appended, pass on exit 0."""
    return sum(sb.run_python(f"{solution}\n{c}\n", DEFAULT_LIMITS).ok for c in checks) / len(checks)


def _sandbox(backend: str) -> Sandbox:
    if backend == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (scripts/bootstrap.sh installs it)")
    return Sandbox(backend=backend)


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    return _sandbox("bwrap" if shutil.which("bwrap") else "unshare")


@pytest.fixture()
def graded_in(monkeypatch):
    """Today's code reward grading in a given sandbox (it grades in the process-wide default one)."""
    def use(sandbox: Sandbox) -> None:
        monkeypatch.setattr(core, "_DEFAULT", sandbox)
    return use


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=[a.name for a in ATTEMPTS])
def test_forgery_scores_zero_and_the_right_solution_one(attempt, sb, graded_in):
    graded_in(sb)
    results = code_case_results(attempt.solution, list(attempt.checks))
    assert [r.passed for r in results] == [False] * len(attempt.checks), results
    assert not any(r.inprocess for r in results)  # every check here is graded out of the solution's reach
    assert code_score(RIGHT, list(attempt.checks)) == 1.0


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=[a.name for a in ATTEMPTS])
def test_control_the_probe_works(attempt, sb):
    """What shows that the attempt does what it says, so that its 0 above is the grader's doing."""
    if attempt.control == "old":
        assert old_score(sb, attempt.solution, attempt.checks) == 1.0
    elif attempt.control == "naive":
        assert naive_score(sb, attempt.solution, attempt.checks) == 1.0
        assert old_score(sb, attempt.solution, attempt.checks) == 0.0  # b4554a1's harness stopped these already
    elif attempt.control == "channel":  # its forged lines reach today's answer channel (and are read as claims only)
        job = json.dumps({"solution": attempt.solution, "steps": [["eval", "add(1, 2)"]]})
        assert attempt.expect in sb.run_python(_EVAL_HARNESS, DEFAULT_LIMITS, stdin=job).stdout
    elif attempt.control == "lie":  # its __str__ reached b4554a1's verdict text; today's reason never calls it
        passed, why = old_case(sb, attempt.solution, CHECKS[0])
        assert '"ok": true' in why and not passed
        today = code_case_results(attempt.solution, [CHECKS[0]])[0]
        assert '"ok"' not in today.why and "Lie" in today.why
    else:  # the value it attacks with is really built (in a bare sandbox run)
        res = sb.run_python(f"{attempt.solution}\n{attempt.measure}\n", DEFAULT_LIMITS)
        assert res.stdout.strip() == attempt.expect, res


@pytest.mark.parametrize("backend", ["bwrap", "unshare"])
def test_the_issue_attacks_passed_on_b4554a1_and_fail_now_on_both_backends(backend, graded_in):
    """The four attacks the issue reported scored 1.0 with a wrong add on b4554a1, on either sandbox backend."""
    sandbox = _sandbox(backend)
    graded_in(sandbox)
    for attempt in ISSUE_FOUR:
        assert old_score(sandbox, attempt.solution, attempt.checks) == 1.0, attempt.name
        assert code_score(attempt.solution, list(attempt.checks)) == 0.0, attempt.name
    assert code_score(RIGHT, list(CHECKS)) == 1.0
