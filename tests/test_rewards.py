import os

os.environ["HF_HUB_OFFLINE"] = "1"

import logging

import pytest
import torch

from hybridflow.models.tiny import build_char_tokenizer
from hybridflow.protocol import Batch
from hybridflow.rewards.loader import RewardFunctionError, load_custom_reward_fn
from hybridflow.rewards.manager import RewardManager
from hybridflow.rewards.scorers import compute_score, exact_answer_score, extract_gsm8k_answer, gsm8k_score


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_exact_answer_score():
    assert exact_answer_score("8", "8") == 1.0
    assert exact_answer_score("3+5=8", "8") == 1.0
    assert exact_answer_score("I think 7, no wait: 8", 8) == 1.0
    assert exact_answer_score("8 or 9", "8") == 0.0  # last integer counts
    assert exact_answer_score("18", "8") == 0.0
    assert exact_answer_score("no number", "8") == 0.0
    assert exact_answer_score("", "0") == 0.0
    assert exact_answer_score("-3", "-3") == 1.0
    assert compute_score("arith_add", "12", "12") == {"score": 1.0, "pred": "12"}
    assert compute_score("arithmetic", "so 13", "12") == {"score": 0.0, "pred": "13"}
    assert compute_score("arithmetic", "none", "12") == {"score": 0.0, "pred": None}


def test_gsm8k_score():
    assert extract_gsm8k_answer("so #### 72") == "72"
    assert extract_gsm8k_answer("#### 1 then #### 1,234") == "1234"
    assert extract_gsm8k_answer("#### $5") == "5"
    assert extract_gsm8k_answer("the answer is 72") is None
    assert gsm8k_score("blah #### 1,234", "1234") == 1.0
    assert gsm8k_score("#### 5\n#### 6", "6") == 1.0
    assert gsm8k_score("#### 5\n#### 6", "5") == 0.0
    assert gsm8k_score("72", "72") == 0.0  # no #### marker -> no credit
    assert compute_score("openai/gsm8k", "#### -4", "-4") == {"score": 1.0, "pred": "-4"}
    assert compute_score("gsm8k", "#### 4.0", "4")["score"] == 1.0


def test_unknown_data_source():
    with pytest.raises(NotImplementedError) as e:
        compute_score("my/task", "1", "1")
    assert "my/task" in str(e.value) and "custom_reward_function.path" in str(e.value)


def test_load_custom_reward_fn(tmp_path):
    assert load_custom_reward_fn(None) is compute_score
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str))\n"
        "def other(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 2.0, 'acc': 1.0}\n"
    )
    fn = load_custom_reward_fn(str(f))
    assert fn("x", "abc", "1") == 3.0
    assert load_custom_reward_fn(str(f), "other")("x", "", "")["score"] == 2.0
    with pytest.raises(RewardFunctionError) as e:
        load_custom_reward_fn(str(tmp_path / "missing.py"))
    assert "custom_reward_function.path" in str(e.value) and "missing.py" in str(e.value)
    with pytest.raises(RewardFunctionError) as e:
        load_custom_reward_fn(str(f), "nope")
    assert "custom_reward_function.name" in str(e.value) and "'nope'" in str(e.value)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RewardFunctionError, match="boom"):
        load_custom_reward_fn(str(broken))


def test_cli_reports_a_reward_file_with_a_syntax_error_in_one_line(tmp_path, tiny_model_dir, task_dir):
    """`hybridflow train` with a custom reward file that does not parse: one line naming the file and
    the SyntaxError, exit status 1, no traceback, before Ray starts."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bad = tmp_path / "syntax.py"
    bad.write_text("def compute_score(data_source, solution_str, ground_truth extra_info=None):\n    return 1.0\n")
    proc = subprocess.run([sys.executable, "-m", "hybridflow.cli", "train", "configs/grpo_tiny.yaml",
                           f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{task_dir}/train.parquet]",
                           f"data.val_files=[{task_dir}/val.parquet]", f"custom_reward_function.path={bad}",
                           f"trainer.default_local_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "Ray" not in proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith("[INFO]")]  # the memory plan's log line
    assert lines == [f"reward function error: custom_reward_function.path: importing {bad} failed: SyntaxError: "
                     f"invalid syntax (syntax.py, line 1)"], proc.stderr


def make_batch(tok, texts, gts, data_source="arith_add", T=6, extra=True):
    rows = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    responses = torch.full((len(rows), T), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[:T]
        responses[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    nt = {"data_source": [data_source] * len(rows), "reward_model": [{"ground_truth": g} for g in gts]}
    if extra:
        nt["extra_info"] = [{"i": i} for i in range(len(rows))]
    return Batch.from_dict(tensors={"responses": responses, "response_mask": mask}, non_tensors=nt)


def test_manager_places_score_at_last_valid_token(tok):
    batch = make_batch(tok, ["8", "12", "1234"], ["8", "11", "1234"], T=6)
    mgr = RewardManager(tok, compute_score)
    scores, metrics = mgr(batch)
    assert scores.shape == (3, 6) and scores.dtype == torch.float32
    expected = torch.zeros(3, 6)
    expected[0, 1] = 1.0  # "8" + eos -> 2 valid tokens
    expected[2, 4] = 1.0  # "1234" + eos -> 5 valid tokens
    assert torch.equal(scores, expected)
    assert metrics["reward/errors"] == 0.0
    assert metrics["reward/mean"] == pytest.approx(2 / 3)
    assert mgr.last_decoded == ["8", "12", "1234"]  # eos skipped


def test_manager_dict_scores_and_default_fn(tok):
    batch = make_batch(tok, ["5", "6"], ["5", "5"], extra=False)
    scores, metrics = RewardManager(tok)(batch)  # default dispatcher
    assert scores.sum(-1).tolist() == [1.0, 0.0]

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "acc": 1.0}

    manager = RewardManager(tok, fn)
    scores, metrics = manager(batch)
    assert scores[0, 1].item() == 0.5 and metrics["reward/acc/mean"] == 1.0
    assert manager.last_extras == {"acc": [1.0, 1.0]} and manager.last_scores == [0.5, 0.5]  # per sample (filter_groups.metric)

    def some(data_source, solution_str, ground_truth, extra_info=None):  # "acc" for one sample only: not per sample
        return {"score": 1.0, "acc": 1.0} if solution_str == "5" else 0.0

    manager = RewardManager(tok, some)
    manager(batch)
    assert manager.last_extras == {}


def test_manager_raising_fn(tok, caplog):
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "7":
            raise ValueError("cannot parse 7")
        return 1.0

    batch = make_batch(tok, ["7", "3", "7", "9"], ["1", "1", "1", "1"])
    with caplog.at_level(logging.WARNING, logger="hybridflow.rewards.manager"):
        scores, metrics = RewardManager(tok, flaky)(batch)
    assert metrics["reward/errors"] == 2.0
    assert scores.sum(-1).tolist() == [0.0, 1.0, 0.0, 1.0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot parse 7" in warnings[0].getMessage()
    # unknown data_source through the default dispatcher is a config error: it propagates
    with pytest.raises(NotImplementedError, match="custom_reward_function.path"):
        RewardManager(tok)(make_batch(tok, ["1"], ["1"], data_source="mystery"))


def test_manager_times_out_a_slow_reward_call(tok):
    import time

    import threading

    finished = threading.Event()

    def slow_on_7(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "7":
            time.sleep(5)
            finished.set()
        return 1.0

    batch = make_batch(tok, ["7", "3"], ["1", "1"])
    scores, metrics = RewardManager(tok, slow_on_7, timeout_s=0.2)(batch)
    assert not finished.is_set()  # returned before the slow call ended, not after it
    assert scores.sum(-1).tolist() == [0.0, 1.0]
    assert metrics["reward/timeouts"] == 1.0 and metrics["reward/errors"] == 0.0
