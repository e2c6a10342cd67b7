"""actor_rollout_ref.rollout.exact: the rollout's log-probs are the trainer's, bit for bit.

The unit tests pin the construction (the sampler's row t at step t equals the finished response's
pass; the KV-cached `generate` sampler, the kernel choice the mode replaces, does not); the end to
end test trains GRPO with the FSDP2 trainer and reads the run's own mismatch metric.
"""

from __future__ import annotations


import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.algorithms import logprobs_from_logits
from hybridflow.config import ConfigError, HybridFlowConfig, load_config, validate_config
from hybridflow.models.exact import exact_row_logits
from hybridflow.protocol import Request, SamplingParams
from hybridflow.rollout.hf_rollout import HFRollout

from conftest import rl_overrides, train_and_read_metrics

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _trainer_log_probs(model, request: Request, c, R: int, pad: int) -> torch.Tensor:
    """The trainer's side, written out: the finished response padded to R, one pass, log-probs."""
    response = torch.full((R,), pad)
    response[: len(c.token_ids)] = torch.tensor(c.token_ids)
    with torch.no_grad():
        logits = exact_row_logits(model, torch.tensor(request.prompt_ids), response, request.params.effective_temperature)
    return logprobs_from_logits(logits, response[None])[0, : len(c.token_ids)]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_exact_sampler_samples_from_the_trainers_numbers_and_generate_does_not(tiny_model_dir, dtype):
    """Sampled with top_k = the vocabulary (nothing cut, so the behaviour log-probs are the step-wise
    ones): each token's step-wise log-prob equals the finished response's pass bit for bit, and so
    does the trainer's computation. The KV-cached HF `generate` sampler differs from it (bf16 by
    ~1e-3, fp32 by ~5e-7 here): the kernel choice this mode replaces."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=DTYPES[dtype]).eval()
    R = 16
    params = SamplingParams(max_new_tokens=R, temperature=0.7, top_k=len(tok), seed=3)
    reqs = [Request(tok.encode(t), params) for t in ("What is 2*3?", "Hi", "a longer prompt than the others")]
    exact = HFRollout(model, tok, "cpu", exact=True).generate_requests(reqs)
    for r, c in zip(reqs, exact):
        assert len(c.token_ids) > 0 and c.log_probs == c.untruncated_log_probs  # step-wise == the finished pass
        assert torch.equal(torch.tensor(c.untruncated_log_probs), _trainer_log_probs(model, r, c, R, tok.pad_token_id))
    default = HFRollout(model, tok, "cpu").generate_requests([Request(r.prompt_ids, params.with_(top_k=-1)) for r in reqs])
    worst = max(float((torch.tensor(c.untruncated) - _trainer_log_probs(model, r, c, R, tok.pad_token_id)).abs().max()) for r, c in zip(reqs, default))
    assert worst > 0.0


def test_exact_mode_refuses_what_it_cannot_hold(tiny_model_dir, task_dir, tmp_path):
    base = rl_overrides(tiny_model_dir, task_dir, tmp_path, "actor_rollout_ref.rollout.exact=true")
    cases = [("actor_rollout_ref.actor.tensor_model_parallel_size=2",
              r"exact=true at actor_rollout_ref\.rollout\.tensor_model_parallel_size=1 needs actor_rollout_ref\.actor\.tensor_model_parallel_size=1"),
             ("actor_rollout_ref.model.use_remove_padding=true",
              r"exact=true runs each sequence alone: set actor_rollout_ref\.model\.use_remove_padding=false"),
             ("actor_rollout_ref.rollout.multi_turn.enable=true", r"exact=true is for single-turn rollouts"),
             # on b4554a1 accepted, and the run's logprob_diff_max was 4.8e-7 to 1.2e-6 instead of 0.0
             (["trainer.async_rollout=true", "async_training.partial_rollout=true", "async_training.partial_rollout_chunk=2",
               "resource_pool.pools.actor_pool.workers_per_node=2", "resource_pool.pools.rollout_pool.workers_per_node=1",
               "resource_pool.mapping.actor_rollout=actor_pool", "resource_pool.mapping.rollout=rollout_pool"],
              r"exact=true samples each response in one pass; async_training\.partial_rollout=true splits responses")]
    for extra, expect in cases:
        with pytest.raises(ConfigError, match=expect):
            validate_config(load_config(None, [*base, *([extra] if isinstance(extra, str) else extra)], schema=HybridFlowConfig))


@pytest.mark.slow
@pytest.mark.parametrize("precision, gen_tp", [("fp32", 2), ("bf16", 1)])
def test_exact_grpo_has_zero_mismatch_and_zero_first_update_kl(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path, precision,
                                                               gen_tp, capsys):
    """10 GRPO steps, 2 workers (FSDP2 training): rollout/logprob_diff_max is 0.0 every step, and so
    is actor/ppo_kl (one mini-batch per step: the first update's ratio is exactly 1), while the
    weights move. gen_tp 1: two replicas sample with the generation model the hybrid engine fills
    (in bf16 the trainer keeps SDPA instead of the CPU bf16 eager switch, or the two differ by
    ~2.5e-3); gen_tp 2: one replica samples with the training engine's module. (fp32 at gen_tp 1 and
    bf16 at gen_tp 2: bench/exact_rollout.py.) The mismatch doctor replaying the last checkpoint outside the
    run (plain HF models, the parameters cast as FSDP2 and the weight sync cast them) agrees."""
    extra = [f"actor_rollout_ref.rollout.tensor_model_parallel_size={gen_tp}"]
    extra += ["actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16"] if precision == "bf16" else []
    rows = train_and_read_metrics(rl_overrides(tiny_model_dir, task_dir, tmp_path, f"custom_reward_function.path={varied_reward}",
                                               "actor_rollout_ref.rollout.exact=true", "trainer.total_training_steps=10",
                                               "data.max_response_length=8", "trainer.save_freq=10", *extra), tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert [r["rollout/logprob_diff_max"] for r in rows] == [0.0] * 10
    assert [r["actor/ppo_kl"] for r in rows] == [0.0] * 10
    assert any(r["actor/pg_loss"] != 0.0 for r in rows) and max(r["actor/grad_norm"] for r in rows) > 0
    from hybridflow.cli import main

    capsys.readouterr()
    assert main(["mismatch", str(tmp_path), "--rows", "4"]) == 0
    out = capsys.readouterr().out
    assert "step 10" in out and "exact" in out and "no probe differs: the two sides agree bit for bit" in out, out
