"""Preference learning without Ray: the losses against the papers' formulas, pair batches and
their sequence log-probs, the reward model's padding-free score, data and config errors."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import logprobs_from_logits
from hybridflow.algorithms.preference import bradley_terry_loss, dpo_loss, seq_log_probs
from hybridflow.config import ConfigError, HybridFlowConfig, load_config, validate_config
from hybridflow.config.schema import ModelConfig
from hybridflow.data.dataset import DataError, chat_ids
from hybridflow.data.preference import PreferenceDataset, collate_pairs, pack_sequences, response_ids
from hybridflow.data.tasks import write_parquet
from hybridflow.protocol import Batch
from hybridflow.trainer.dpo import best_vs_worst
from hybridflow.engine.model import response_logits
from hybridflow.models.hf import load_hf_model
from conftest import rl_overrides

# One pair: policy log-probs (chosen, rejected), reference log-probs (chosen, rejected).
PC, PR, RC, RR = -1.0, -2.0, -1.5, -1.5
H = (PC - PR) - (RC - RR)  # the policy's log-ratio margin over the reference: 1.0


def _loss(loss_type, beta, label_smoothing=0.0):
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    losses, chosen, rejected = dpo_loss(t(PC), t(PR), t(RC), t(RR), beta, loss_type, label_smoothing)
    return losses.item(), chosen.item(), rejected.item()


def _log_sigmoid(x):
    return -math.log1p(math.exp(-x))


def test_dpo_losses_match_the_papers_formulas():
    beta = 0.5
    loss, chosen, rejected = _loss("sigmoid", beta)
    assert loss == pytest.approx(-_log_sigmoid(beta * H), abs=1e-12)  # DPO eq. 7
    assert (chosen, rejected) == (pytest.approx(beta * (PC - RC)), pytest.approx(beta * (PR - RR)))
    eps = 0.1  # conservative DPO: the label is flipped with probability eps
    assert _loss("sigmoid", beta, eps)[0] == pytest.approx(-(1 - eps) * _log_sigmoid(beta * H) - eps * _log_sigmoid(-beta * H), abs=1e-12)
    assert _loss("ipo", 0.25)[0] == pytest.approx((H - 1 / (2 * 0.25)) ** 2, abs=1e-12)  # IPO eq. 17: (h - 1/(2 tau))^2
    assert _loss("hinge", beta)[0] == pytest.approx(max(0.0, 1 - beta * H), abs=1e-12)  # SLiC
    assert _loss("hinge", 4.0)[0] == 0.0  # beyond the margin: no loss
    with pytest.raises(ValueError, match="loss_type"):
        _loss("kto", beta)


def test_equal_policy_and_reference_give_log_2_and_zero_margin():
    x = torch.tensor([-3.0, -0.5])
    losses, chosen, rejected = dpo_loss(x, x.flip(0), x, x.flip(0), beta=0.1)
    assert torch.allclose(losses, torch.full((2,), math.log(2)))
    assert (chosen - rejected).abs().max() == 0


def test_bradley_terry_loss_by_hand():
    c, r = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.5])
    assert torch.allclose(bradley_terry_loss(c, r), torch.tensor([math.log1p(math.exp(-1.0)), math.log1p(math.exp(0.5))]))
    # The margin term asks for r_c - r_r >= margin: -log sigma(1 - 1) = log 2
    assert bradley_terry_loss(c[:1], r[:1], 1.0).item() == pytest.approx(math.log(2))


@pytest.fixture(scope="module")
def tok_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir), AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def test_pair_sequence_log_probs_with_padding_equal_unpadded(tok_model, tmp_path):
    """Prompts of different lengths (left-padded) and responses of different lengths (right-padded):
    each row's sequence log-prob equals an unpadded forward of that prompt + response alone."""
    tok, model = tok_model
    rows = [{"prompt": [{"role": "user", "content": "max 1 2 3"}], "chosen": "3", "rejected": "12"},
            {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "max 9 0 4 5"}],
             "chosen": "9", "rejected": "hello"}]
    path = write_parquet(rows, tmp_path / "pref.parquet")
    ds = PreferenceDataset([path], tok, max_prompt_length=48, max_response_length=8)
    batch = collate_pairs(list(ds), tok.pad_token_id, 48, 8)
    assert len(batch) == 4 and batch["pair_weight"].tolist() == [1.0] * 4
    with torch.no_grad():
        got = seq_log_probs(logprobs_from_logits(response_logits(model, batch), batch["responses"]), batch["response_mask"])
        want = []
        for item in ds:
            for resp in (item["chosen_ids"], item["rejected_ids"]):
                p = item["prompt_ids"]
                logits = model(torch.tensor([p + resp])).logits[0, len(p) - 1 : -1]
                want.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None]).sum())
    assert torch.allclose(got, torch.stack(want), atol=1e-5)
    mean = seq_log_probs(logprobs_from_logits(response_logits(model, batch), batch["responses"]), batch["response_mask"], average=True)
    assert torch.allclose(mean, got / batch["response_mask"].sum(-1), atol=1e-6)  # IPO's length-averaged log-probs


def test_reward_model_score_ignores_padding(tmp_path, tok_model):
    from hybridflow.models.tiny import make_tiny_model

    tok, _ = tok_model
    rm = load_hf_model(ModelConfig(path=str(make_tiny_model(tmp_path / "rm", reward=True))), "cpu", kind="reward").eval()
    prompts = [chat_ids(tok, [{"role": "user", "content": "max 1 2"}]), chat_ids(tok, [{"role": "user", "content": "max 7 3 9 1"}])]
    responses = [response_ids(tok, "2"), response_ids(tok, "9 is it")]

    def scores(p_len, r_len):
        b = pack_sequences(prompts, responses, tok.pad_token_id, p_len, r_len)
        with torch.no_grad():
            return rm(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits.squeeze(-1)

    with torch.no_grad():
        alone = torch.stack([rm(input_ids=torch.tensor([p + r])).logits[0, 0] for p, r in zip(prompts, responses)])
    assert torch.allclose(scores(max(map(len, prompts)), max(map(len, responses))), alone, atol=1e-5)
    assert torch.allclose(scores(40, 16), alone, atol=1e-5)  # more padding on both sides: same scores


def test_bad_preference_rows_name_file_and_row(tmp_path, tok_model):
    tok, _ = tok_model
    good = {"prompt": [{"role": "user", "content": "max 1 2 3"}], "chosen": "3", "rejected": "1"}
    chat = {**good, "chosen": [{"role": "assistant", "content": "3"}]}  # chosen as an assistant chat list
    cases = [  # (rows, the bad row's number, message); a parquet column holds one type, so a good row matches the bad one's types
        ([good, {"prompt": good["prompt"], "rejected": "1"}], 1, "column 'chosen' is missing"),
        ([good, {"prompt": good["prompt"], "chosen": "3", "rejected": None}], 1, "column 'rejected' is missing or null"),
        ([chat, chat, {**good, "chosen": [{"role": "user", "content": "3"}]}], 2, "assistant messages only"),
        ([{**good, "prompt": "max 1 2 3"}], 0, "chat list"),
    ]
    assert PreferenceDataset([write_parquet([chat], tmp_path / "chat.parquet")], tok, 48, 8)[0]["chosen"] == "3"
    for i, (rows, row_no, message) in enumerate(cases):
        path = write_parquet(rows, tmp_path / f"bad{i}.parquet")
        with pytest.raises(DataError, match=message) as e:
            PreferenceDataset([path], tok, 48, 8)
        assert f"{path} row {row_no}" in str(e.value)


def test_margin_column_reaches_the_pair_batch(tmp_path, tok_model):
    tok, _ = tok_model
    rows = [{"prompt": [{"role": "user", "content": "max 1 2 3"}], "chosen": "3", "rejected": "1", "margin": m} for m in (0.5, 2)]
    batch = collate_pairs(list(PreferenceDataset([write_parquet(rows, tmp_path / "m.parquet")], tok, 48, 8)), tok.pad_token_id, 48, 8)
    assert batch["margin"].tolist() == [0.5, 0.5, 2.0, 2.0]
    rows[1]["margin"] = None
    with pytest.raises(DataError, match="row 1: column 'margin' must be a number"):
        PreferenceDataset([write_parquet(rows, tmp_path / "bad.parquet")], tok, 48, 8)


def test_best_vs_worst_pairs_and_ties():
    n, R = 3, 2
    scores = torch.tensor([0.0, 1.0, 0.5, 2.0, 2.0, 2.0])  # prompt 0: best row 1, worst row 0; prompt 1: a tie
    tensors = {k: torch.arange(6)[:, None].repeat(1, R) for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")}
    tls = torch.zeros(6, R)
    tls[:, -1] = scores
    samples = Batch.from_dict(tensors={**tensors, "token_level_scores": tls}, non_tensors={"uid": ["a"] * 3 + ["b"] * 3})
    pairs, metrics = best_vs_worst(samples, n)
    assert pairs["input_ids"][:, 0].tolist() == [1, 0, 3, 3]
    assert pairs["pair_weight"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert metrics["dpo/tie_fraction"] == 0.5
    samples.non_tensors["uid"][1] = "b"
    with pytest.raises(ValueError, match="consecutive"):
        best_vs_worst(samples, n)


def _cfg(tiny_model_dir, task_dir, tmp_path, *extra):
    return load_config(None, rl_overrides(tiny_model_dir, task_dir, tmp_path, *extra), schema=HybridFlowConfig)


def test_reward_model_that_is_not_a_sequence_classifier_is_a_config_error(tiny_model_dir, task_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, task_dir, tmp_path, "reward_model.enable=true", f"reward_model.model.path={tiny_model_dir}")
    with pytest.raises(ConfigError, match=r"reward_model.model.path: .* is not a sequence classifier"):
        validate_config(cfg)


def test_dpo_config_errors_name_the_key(tiny_model_dir, task_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"dpo.loss_type must be one of \['sigmoid', 'ipo', 'hinge'\], got 'ipoo'; did you mean 'ipo'"):
        _cfg(tiny_model_dir, task_dir, tmp_path, "dpo.loss_type=ipoo")
    cfg = _cfg(tiny_model_dir, task_dir, tmp_path, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "dpo.beta=0",
               "dpo.label_smoothing=0.1", "dpo.loss_type=hinge", "dpo.online=true", "actor_rollout_ref.rollout.n=1")
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, "dpo")
    for key in ("ppo_micro_batch_size_per_gpu (3) must be even", "dpo.beta must be > 0", "dpo.label_smoothing (conservative DPO) applies",
                "rollout.n must be >= 2 with dpo.online=true"):
        assert key in str(e.value)
    validate_config(_cfg(tiny_model_dir, task_dir, tmp_path), "dpo")  # the RL test config is a valid offline DPO config
    with pytest.raises(ConfigError, match="trainer.async_rollout applies to `hybridflow train`"):
        validate_config(_cfg(tiny_model_dir, task_dir, tmp_path, "trainer.async_rollout=true"), "dpo")


def test_remax_with_a_reward_model_is_refused(tiny_model_dir, task_dir, tmp_path):
    from hybridflow.models.tiny import make_tiny_model

    rm = make_tiny_model(tmp_path / "rm", reward=True)
    validate_config(_cfg(tiny_model_dir, task_dir, tmp_path, "reward_model.enable=true", f"reward_model.model.path={rm}"))
    with pytest.raises(ConfigError, match="remax scores its greedy baseline with the rule reward only"):
        validate_config(_cfg(tiny_model_dir, task_dir, tmp_path, "reward_model.enable=true", f"reward_model.model.path={rm}",
                             "algorithm.adv_estimator=remax"))
