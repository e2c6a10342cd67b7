"""Out-of-process grading of assert-style checks (rewards/code_checks.py, code_host.py, code_eval_harness.py).

The oracle is Python itself: for honest solutions (ours, trusted), a check passes under the grader
exactly when ``exec(solution + check)`` runs without an exception. The shapes are the test
formats of the data sets code-RL users train on: MBPP (asserts, ``math.isclose``, ``set(...) ==``),
HumanEval (``def check(candidate)`` + ``check(fn)``, ``abs(...) < tol``), APPS / TACO call-based
(``fn_name``), LeetCode-style ``Solution().method``.
"""

from __future__ import annotations

import collections
import json
import math
import os

import pytest
import torch

from hybridflow.rewards import code_host
from hybridflow.rewards.code import _EVAL_HARNESS, code_case_results, code_reward, code_score
from hybridflow.rewards.code_checks import NotGradable, Step, plan_check
from hybridflow.rewards.code_host import CheckFailed, decode_value, parse_answers
from hybridflow.rewards.manager import RewardManager

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/ns/user"), reason="needs Linux namespaces")

# (solution, checks): each solution is honest code; some of its checks fail by design.
SHAPES = {
    "mbpp": ("import math\ndef similar_elements(a, b):\n    return tuple(set(a) & set(b))\n"
             "def area(r):\n    return 3.1415 * r * r\n",
             ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
              "assert similar_elements((1, 2), (3, 4)) == ()",
              "assert math.isclose(area(10), 314.15, rel_tol=0.001)",
              "assert math.isclose(area(10), 314.0, rel_tol=1e-6)",  # fails
              "assert sorted(similar_elements((1, 2, 3), (3, 2))) == [2, 3]"]),
    "humaneval": ("def truncate_number(number: float) -> float:\n    return number % 1.0\n",
                  ["METADATA = {'author': 'jt', 'dataset': 'test'}\n\ndef check(candidate):\n"
                   "    assert candidate(3.5) == 0.5\n    assert abs(candidate(1.33) - 0.33) < 1e-6\n"
                   "    assert abs(candidate(123.456) - 0.456) < 1e-6\n\ncheck(truncate_number)\n",
                   "def check(candidate):\n    assert candidate(2.25) == 0.5\n\ncheck(truncate_number)\n"]),  # fails
    "types_and_none": ("def parse(s):\n    return None if not s else int(s)\n",
                       ["assert parse('') is None", "assert isinstance(parse('12'), int)", "assert parse('7') is not None",
                        "assert not parse('')", "assert parse('3') in (1, 2, 3)", "assert 0 < parse('5') < 10",
                        "assert isinstance(parse('1'), str)",  # fails
                        "assert parse('x') == 1"]),  # raises ValueError: fails
    "strings_and_methods": ("def greet(n):\n    return f'Hello, {n}!'\n",
                            ["assert greet('Bo').startswith('Hello')", "assert greet('Bo').lower() == 'hello, bo!'",
                             "assert len(greet('Bo')) == 10", "assert greet('Bo')[7:9] == 'Bo'",
                             "assert greet('Bo').split(', ')[1] == 'Bo!'",
                             "assert greet('Bo').endswith('?')"]),  # fails
    "statements": ("class Stack:\n    def __init__(self):\n        self.items = []\n"
                   "    def push(self, x):\n        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n",
                   ["s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert s.pop() == 1",
                    "x = [1, 2]\ny = x + [3]\ns = Stack()\ns.push(y)\nassert s.pop() == [1, 2, 3]",
                    "s = Stack()\nassert s.pop() == 1"]),  # raises IndexError: fails
    "lru_cache": ("class LRUCache:\n    def __init__(self, n):\n        self.n, self.d = n, {}\n"
                  "    def get(self, k):\n        if k not in self.d:\n            return -1\n"
                  "        self.d[k] = self.d.pop(k)\n        return self.d[k]\n"
                  "    def put(self, k, v):\n        self.d.pop(k, None)\n        self.d[k] = v\n"
                  "        if len(self.d) > self.n:\n            self.d.pop(next(iter(self.d)))\n",
                  ["c = LRUCache(2)\nc.put(1, 1)\nc.put(2, 2)\nassert c.get(1) == 1\nc.put(3, 3)\nassert c.get(2) == -1",
                   "c = LRUCache(1)\nc.put(1, 1)\nc.put(2, 2)\nassert c.get(1) == 1"]),  # fails
    "leetcode": ("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
                 "        for i, n in enumerate(nums):\n            if target - n in seen:\n"
                 "                return [seen[target - n], i]\n            seen[n] = i\n",
                 ["assert Solution().twoSum([2, 7, 11, 15], 9) == [0, 1]", "assert Solution().twoSum([3, 3], 6) == [1, 0]"]),
    "collections": ("import collections\ndef count(s):\n    return collections.Counter(s)\n"
                    "P = collections.namedtuple('P', 'x y')\ndef point():\n    return P(1, 2)\n",
                    ["assert count('aab') == {'a': 2, 'b': 1}", "assert point() == (1, 2)", "assert point().x == 1",
                     "assert count('ab') == {'a': 2}"]),  # fails
    "containers": ("def stats(xs):\n    return {'min': min(xs), 'max': max(xs), 'pair': (xs[0], xs[-1]), 'set': frozenset(xs),"
                   " 'c': complex(1, 2), 'b': bytes([65])}\n",
                   ["assert stats([3, 1, 2]) == {'min': 1, 'max': 3, 'pair': (3, 2), 'set': frozenset({1, 2, 3}), "
                    "'c': 1+2j, 'b': b'A'}",
                    "assert stats([1])['pair'] == [1, 1]",  # a tuple is not a list: fails, as in Python
                    "assert stats([5, 6])['max'] - stats([5, 6])['min'] == 1"]),
}


def python_says(solution: str, check: str) -> bool:
    """The oracle: does the check pass when Python runs it after the (trusted) solution?"""
    ns: dict = {}
    try:
        exec(compile(solution + "\n" + check, "oracle", "exec"), ns)
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_verdicts_equal_pythons_own(shape):
    solution, checks = SHAPES[shape]
    results = code_case_results(solution, checks)
    assert [r.passed for r in results] == [python_says(solution, c) for c in checks], results
    assert not any(r.inprocess for r in results)  # every shape here is graded outside the solution's process
    assert any(r.passed for r in results) and not all(r.passed for r in results)  # both verdicts are exercised


def test_the_sandbox_never_sees_the_checks_own_values():
    """The expected side stays here; the sandbox gets the solution's calls with their inputs."""
    cases = {
        "assert add(1, 2) == 3": ["add(1, 2)"],
        "assert abs(f(3.5) - 0.5) < 1e-6": ["f(3.5)"],
        "assert math.isclose(area(5), 78.5, rel_tol=0.001)": ["area(5)"],
        "assert isinstance(f(2), int)": ["f(2)"],
        "assert f('ab').startswith('xy')": ["f('ab')"],  # a predicate method: called here, on the plain value
        "assert f('ab').count('a') == 2": ["f('ab').count('a')"],  # another method: the solution's call, 2 stays here
        "assert sorted(f([3, 1]), reverse=True) == [3, 1]": ["f([3, 1])"],
        "expected = 6\nx = [1, 2]\nassert f(x) == expected": ["x = [1, 2]", "f(x)"],
        "assert str(Node(1)) == '1'": ["str(Node(1))"],  # no value of the check's own inside: evaluated whole
    }
    for check, sent in cases.items():
        assert [s.source for s in plan_check(check).steps] == sent, check


def test_checks_that_do_not_fit_run_in_process_are_counted_and_strict_refuses_them():
    loop = "for i in range(3):\n    assert add(i, 1) == i + 1"
    right = "def add(a, b):\n    return a + b\n"
    with pytest.raises(NotGradable):
        plan_check(loop)
    for check in ("assert all(add(i, 0) == i for i in range(3))", "try:\n    add()\nexcept TypeError:\n    pass\nelse:\n    assert False",
                  "assert np.allclose(add(1, 2), 3)"):
        with pytest.raises(NotGradable):
            plan_check(check)
    res = code_case_results(right, [loop, "assert add(1, 2) == 3"])
    assert [(r.passed, r.inprocess) for r in res] == [(True, True), (True, False)]
    strict = code_case_results(right, [loop, "assert add(1, 2) == 3"], strict=True)
    assert [(r.passed, r.inprocess) for r in strict] == [(False, True), (True, False)] and "strict" in strict[0].why
    assert code_reward(right, [loop, loop, "assert add(1, 2) == 3"]) == {"score": 1.0, "code_inprocess_checks": 2.0}


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_reward_manager_sums_inprocess_checks_and_passes_strict():
    from hybridflow.protocol import Batch

    loop = "for i in range(2):\n    assert add(i, 1) == i + 1"
    text = "def add(a, b):\n    return a + b\n"
    ids = torch.tensor([[ord(c) for c in text]] * 2)
    batch = Batch(tensors={"responses": ids, "response_mask": torch.ones_like(ids)},
                  non_tensors={"data_source": ["code", "code"], "reward_model": [{"ground_truth": [loop]}, {"ground_truth": [loop, loop]}]})
    scores, metrics = RewardManager(_CharTokenizer())(batch)
    assert metrics["reward/code_inprocess_checks"] == 3.0 and scores.sum().item() == 2.0
    scores, metrics = RewardManager(_CharTokenizer(), code_strict=True)(batch)
    assert metrics["reward/code_inprocess_checks"] == 3.0 and scores.sum().item() == 0.0


def test_call_based_cases_compare_like_verls_prime_code_grader():
    fn = "def double(x):\n    return (x * 2, x)\n"
    # APPS wraps outputs in a list; a tuple counts as a list
    assert code_score(fn, {"fn_name": "double", "inputs": [[1], [2]], "outputs": [[[2, 1]], [4, 2]]}) == 1.0
    assert code_score(fn, {"fn_name": "double", "inputs": [[1]], "outputs": [[3, 1]]}) == 0.0
    cls = "class Solution:\n    def add(self, a, b):\n        return a + b\n"
    assert code_score(cls, '{"fn_name": "add", "inputs": [[1, 2], [0, 0]], "outputs": [3, 1]}') == 0.5
    eq = "class E:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return E()\n"
    assert code_score(eq, {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}) == 0.0


def _harness_encode():
    ns: dict = {"__name__": "not_main"}
    exec(compile(_EVAL_HARNESS.replace("\nmain()\n", "\n"), "harness", "exec"), ns)
    return ns["encode"]


def _same(a, b) -> bool:
    """Equal with the same exact types all the way down (1 == 1.0 == True would hide a wrong type)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) and _same(k, k2) for k, k2 in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def test_values_round_trip_as_plain_data_and_nothing_else_passes():
    encode = _harness_encode()
    values = [None, True, 0, -(10 ** 40), 1.5, float("inf"), float("nan"), -0.0, 1 + 2j, "x\n\u00e9", b"\x00\xff",
              [1, [2.0, "3"]], (1, (2,)), {1: "a", "b": (2, None), (1, 2): [3]}, {1, 2}, frozenset({"a"}), [], ()]
    for v in values:
        assert _same(decode_value(json.loads(json.dumps(encode(v)))), v), v

    class Sub(int):
        def __eq__(self, other):
            return True
        __hash__ = int.__hash__

    # a subclass of a plain type crosses as its base type's value, without its __eq__
    for v, plain in ((Sub(1), 1), ([Sub(2)], [2]), (collections.Counter("aab"), {"a": 2, "b": 1}),
                     (collections.namedtuple("P", "x y")(1, 2), (1, 2)), (collections.OrderedDict(a=1), {"a": 1})):
        assert _same(decode_value(json.loads(json.dumps(encode(v)))), plain)
    for bad in (object(), range(3), iter([1]), {"k": object()}, collections.deque([1])):
        with pytest.raises(TypeError, match="not plain data"):
            encode(bad)
    deep = 1
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ValueError, match="deeper"):
        encode(deep)
    for bad in ({"int": 1}, {"set": [[1]]}, {"x": "1"}, {"int": "1", "float": "2"}, {"bytes": "zz"}):
        with pytest.raises((ValueError, TypeError)):
            decode_value(bad)


def test_answers_are_read_once_per_step():
    steps = [Step("eval", "f(1)"), Step("exec", "s = S()"), Step("eval", "f(2)")]
    out = "\n".join(['{"i": 0, "v": {"int": "3"}}', '{"i": 1}', '{"i": 2, "v": true}', '{"i": 2, "v": false}',
                     '{"i": 7, "v": 1}', 'noise', '{"i": 0, "v"'])
    answers = parse_answers(out, steps)
    assert answers[0] == (True, 3) and answers[1] == (True, None) and answers[2] == (False, "the step was answered twice")
    assert 7 not in answers


def test_host_side_evaluation_is_bounded():
    """The host computes with the solution's claimed values: its own work stays bounded."""
    plan = plan_check("assert f(1) * 10 ** 9 == 'x'")
    ok, why = code_host.grade(plan, {0: (True, "x" * 1000)}, "missing")
    assert not ok and "bound" in why
    plan = plan_check("assert list(range(f(0), 10 ** 12)) == []")
    ok, why = code_host.grade(plan, {0: (True, 0)}, "missing")
    assert not ok and "bound" in why
    assert [s.source for s in plan_check("assert math.factorial(f(1)) == 1").steps] == ["math.factorial(f(1))"]  # all sandbox-side
    plan = plan_check("assert math.factorial(f(1) + 0) == 1")  # the 0 keeps factorial here, where it is not offered
    ok, why = code_host.grade(plan, {0: (True, 10 ** 6)}, "missing")
    assert not ok and "math.factorial is not available" in why
    with pytest.raises(CheckFailed):
        code_host._eval(plan.host_ops[0][2], {}, {})  # a hole with no answer
