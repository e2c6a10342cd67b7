"""The `math` scorer: answers compared as math, not strings (hybridflow/rewards/math.py)."""

import psutil
import pytest

from hybridflow.rewards.math import extract_answer, is_equiv, math_score
from hybridflow.rewards.scorers import compute_score

# (the model's answer, the ground truth, equal?): each decided by hand.
PAIRS = [
    # fractions and decimals
    (r"\frac{1}{2}", "0.5", True), (r"\dfrac{1}{2}", r"\frac12", True), (r"\tfrac{3}{4}", "0.75", True),
    (r"-\frac{3}{4}", "-0.75", True), (r"\frac{-3}{4}", "-0.75", True), ("0.333", r"\frac13", False),
    (r"\frac{a}{b}", "a/b", True), ("2/4", r"\frac{1}{2}", True),
    # thousands separators, signs, trailing periods, scientific notation
    ("1,000", "1000", True), ("1,234,567", "1234567", True), ("-3", "-3.0", True), ("-3", "3", False),
    ("12.", "12", True), ("+7", "7", True), ("1e3", "1000", True), ("7", "7.0001", False), ("10", "100", False),
    # percentages: a percentage equals its number and its fraction
    (r"50\%", "0.5", True), (r"50\%", "50", True), ("50%", "0.5", True), (r"50\%", "5", False),
    # units, degrees, dollars, assignments, text answers
    ("5 cm", "5", True), (r"5\text{ cm}", "5", True), (r"10^\circ", "10", True), (r"10^{\circ}", "10", True),
    (r"\$12", "12", True), ("x=5", "5", True), ("x = -2", "-2", True), (r"\text{yes}", "yes", True), ("abc", "abd", False),
    # intervals, tuples, sets
    ("(1,2]", "(1, 2]", True), ("(1,2]", "[1,2]", False), ("[-1, 3)", "[-1,3)", True), (r"(-\infty, 0)", r"(-\infty,0)", True),
    ("(3, 4)", "(3,4)", True), ("(3, 4)", "(4,3)", False), (r"\{1,2\}", r"\{2,1\}", True),
    # radicals, pi, expressions
    (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}", True), (r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}", True),
    (r"3\sqrt{2}", r"\sqrt{18}", True), (r"2\pi", r"2 \pi", True), (r"\pi", "3.14", False),
    ("x^2+2x+1", "(x+1)^2", True), ("2x+1", "2x-1", False), (r"\infty", r"\infty", True),
    # malformed LaTeX and empty answers
    (r"\frac{1}{2", "0.5", False), ("", "1", False), (r"\sqrt{", "2", False),
]


def test_table_of_answer_pairs():
    assert len(PAIRS) >= 40
    wrong = [(a, b, want) for a, b, want in PAIRS if is_equiv(a, b) != want]
    assert not wrong, wrong


@pytest.mark.parametrize("text,answer", [
    (r"so the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
    (r"\boxed{1} at first, then \boxed{\{1, \{2\}\}}", r"\{1, \{2\}\}"),  # the last box; nested braces
    (r"\fbox{3}", "3"), (r"$\boxed 5$", "5"),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"), ("#### 1,000", "1,000"),
    ("the total is 42 apples.", "42"), ("no answer here", None), (r"\boxed{1", "1"),  # an unclosed box: the last number
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_math_score_and_dispatch():
    assert math_score(r"Thus $\boxed{\dfrac{1}{2}}$.", "0.5") == {"score": 1.0, "acc": 1.0, "pred": r"\frac{1}{2}", "timeout": 0.0}
    assert math_score("I give up", "0.5")["score"] == 0.0
    for source in ("lighteval/MATH", "HuggingFaceH4/MATH-500", "math"):
        assert compute_score(source, r"\boxed{1,000}", "1000")["score"] == 1.0
    assert compute_score("gsm8k", "... #### 1,000", "1000")["score"] == 1.0


def test_pathological_expression_times_out_scores_zero_and_leaves_nothing_running():
    from hybridflow.rewards.math import _VERIFIER

    math_score(r"\boxed{\sqrt{4}}", "2")  # the helper process is up
    helper = psutil.Process(_VERIFIER._proc.pid)
    out = math_score(r"\boxed{9^{9^{9^{9}}}}", "1", timeout_s=2.0)  # returns at the limit (sympy alone would not)
    assert out["score"] == 0.0 and out["timeout"] == 1.0
    assert not helper.is_running() or helper.status() == psutil.STATUS_ZOMBIE  # killed with its comparison
    assert math_score(r"\boxed{\sqrt{4}}", "2")["score"] == 1.0  # a fresh helper answers the next one


def test_prepare_gsm8k_and_math_files_into_rl_rows_the_scorer_grades(tmp_path, tiny_model_dir):
    """`hybridflow prepare`: JSONL (GSM8K) and parquet (MATH) -> RL parquet that RLDataset loads;
    each row's own reference solution scores 1.0 under its data source, a wrong one 0.0."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from transformers import AutoTokenizer

    from hybridflow.cli import main
    from hybridflow.data.dataset import RLDataset

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text("\n".join(json.dumps(r) for r in [
        {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?", "answer": "48/2 = 24\n48+24 = 72\n#### 72"},
        {"question": "A shop sells 1,200 pens a day. How many in 3 days?", "answer": "1,200*3 = 3,600\n#### 3,600"},
    ]) + "\n")
    math_rows = [{"problem": "What is $\\frac{2}{4}$ as a fraction in lowest terms?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
                  "type": "Prealgebra"},
                 {"problem": "Solve $x^2 = 4$ for $x > 0$.", "solution": "So $x = \\boxed{2}$.", "level": "Level 2", "type": "Algebra"}]
    pq.write_table(pa.Table.from_pylist(math_rows), tmp_path / "math.parquet")
    out_g, out_m = tmp_path / "g.parquet", tmp_path / "m.parquet"
    assert main(["prepare", str(gsm), "--split", "test", "-o", str(out_g)]) == 0
    assert main(["prepare", str(tmp_path / "math.parquet"), "--format", "math", "-o", str(out_m)]) == 0
    g, m = pq.read_table(out_g).to_pylist(), pq.read_table(out_m).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in g] == ["72", "3600"] and g[1]["data_source"] == "openai/gsm8k"
    assert g[0]["extra_info"]["split"] == "test" and g[1]["extra_info"]["index"] == 1
    assert g[0]["prompt"][0]["content"].endswith('output the final answer after "####".')
    assert [r["reward_model"]["ground_truth"] for r in m] == ["\\frac{1}{2}", "2"] and m[0]["extra_info"]["type"] == "Prealgebra"
    for rows, path in ((g, out_g), (m, out_m)):
        ds = RLDataset([str(path)], tok, max_prompt_length=256)
        assert len(ds) == len(rows)
        for r in rows:
            truth = r["reward_model"]["ground_truth"]
            assert compute_score(r["data_source"], r["extra_info"]["answer"], truth)["score"] == 1.0
            assert compute_score(r["data_source"], "#### 5\n\\boxed{5}", truth)["score"] == 0.0


def test_prepare_names_the_bad_row(tmp_path, capsys):
    import json

    from hybridflow.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + json.dumps({"question": "q2", "answer": "no marker"}) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["prepare", str(bad), "-o", str(tmp_path / "o.parquet")])
    assert e.value.code == 2
    assert f"{bad} row 1: the solution in 'answer' has no final answer after '####'" in capsys.readouterr().err
    assert main(["prepare", str(bad), "--skip-bad", "-o", str(tmp_path / "o.parquet")]) == 0
    assert "1 rows without a final answer skipped" in capsys.readouterr().out
