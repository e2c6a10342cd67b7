"""`hybridflow prepare --reasoning-gym`: rows scored by reasoning-gym's own verifiers. Oracle: the
task's dataset regenerated from its name, seed and config (not from our parquet), its own
`score_answer` on the same candidate answers."""

from __future__ import annotations

import pandas as pd
import pytest

from hybridflow.rewards.scorers import compute_score
from hybridflow.utils.prepare import main_prepare

TASKS = {"chain_sum": {"min_terms": 2, "max_terms": 3, "max_digits": 2}, "spell_backward": {"min_word_len": 3, "max_word_len": 5}}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_prepared_rows_score_as_reasoning_gyms_own_verifier_on_100_rows(tmp_path, name):
    import reasoning_gym

    cfg = TASKS[name]
    out = tmp_path / f"{name}.parquet"
    assert main_prepare(["--reasoning-gym", name, "--size", "100", "--seed", "7", "-o", str(out), "--split", "val",
                         "--rg-config", *[f"{k}={v}" for k, v in cfg.items()]]) == 0
    rows = pd.read_parquet(out).to_dict("records")
    oracle = reasoning_gym.create_dataset(name, size=100, seed=7, **cfg)
    assert len(rows) == 100
    scores = []
    for i, row in enumerate(rows):
        entry = oracle[i]
        assert row["prompt"][0]["content"].startswith(entry["question"]) and row["reward_model"]["ground_truth"] == entry["answer"]
        gold = entry["answer"]
        for cand in (gold, gold + "7", gold[:-1] or "x", "so " + gold, "12"):
            got = compute_score(row["data_source"], f"thinking... <answer> {cand} </answer>", gold, row["extra_info"])["score"]
            want = oracle.score_answer(cand, entry)  # the answer inside the tags, stripped
            assert got == want, (i, cand, got, want)
            scores.append(got)
        assert compute_score(row["data_source"], gold, gold, row["extra_info"])["score"] == 0.0  # no <answer> tags
    assert 0 < sum(s == 1.0 for s in scores) < len(scores)  # the candidates are not all right (the check can fail)


def test_bad_task_and_missing_inputs_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main_prepare(["--reasoning-gym", "no_such_task", "-o", str(tmp_path / "x.parquet")])
    assert e.value.code == 2 and "no_such_task" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main_prepare(["-o", str(tmp_path / "x.parquet")])
