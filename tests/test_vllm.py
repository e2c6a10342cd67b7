"""The vLLM rollout backend, colocated in the actor workers (runs in .venv-vllm: scripts/test.sh)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import rl_overrides
from hybridflow.config import HybridFlowConfig, load_config
from hybridflow.trainer.rl import RLTrainer

# No skip when vLLM is missing: scripts/test.sh runs these in .venv-vllm, where a broken install must fail, not pass green.
pytestmark = [pytest.mark.vllm]


def test_vllm_grpo_learns_and_matches_trainer_logprobs(ray_cluster, tmp_path):
    from hybridflow.cli import main as cli_main

    out = tmp_path / "demo"
    assert cli_main(["demo", "--output-dir", str(out), "--rl-steps", "10", "trainer.progress_bar=false", "actor_rollout_ref.rollout.name=vllm"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    # the HF backend's demo: 0.021 -> 0.910 held-out at step 10 (docs/performance.md); vLLM samples the same policy
    assert summary["val_acc_final"] >= 0.6 and summary["val_acc_final"] >= 2 * summary["val_acc_after_sft"]
    steps_all = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines() if '"critic/score/mean"' in line]
    scores = [s["critic/score/mean"] for s in steps_all]
    assert len(scores) == 10 and sum(scores[-5:]) / 5 > sum(scores[:5]) / 5  # training reward, averaged over 5 steps each end
    steps = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "rollout/logprob_diff_max" in s]
    assert len(steps) == 10
    # vLLM's log-probs of its samples vs the FSDP2 trainer's recomputation, fp32, every step.
    assert max(s["rollout/logprob_diff_max"] for s in steps) < 1e-3
    assert all(abs(s["actor/ppo_kl"]) < 1e-6 for s in steps)


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    from hybridflow.models.tiny import make_tiny_model

    # vLLM's CPU attention needs a head size of at least 32.
    return make_tiny_model(tmp_path_factory.mktemp("vllm") / "m", hidden_size=64, num_attention_heads=2, num_key_value_heads=2)


def test_vllm_settings_the_platform_cannot_run_fail_before_workers(tiny_model_dir, task_dir, tmp_path):
    from hybridflow.config import ConfigError, HybridFlowConfig, load_config, validate_config

    cfg = load_config(None, rl_overrides(tiny_model_dir, task_dir, tmp_path, "actor_rollout_ref.rollout.name=vllm",
                                         "actor_rollout_ref.model.dtype=float16", "actor_rollout_ref.rollout.cpu_kv_cache_gb=1000"), schema=HybridFlowConfig)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    msg = str(e.value)
    assert "head_dim 16 is not supported" in msg
    assert "float16" in msg and "cpu_kv_cache_gb=1000" in msg
    # bf16 mixed precision makes the generation bf16 too: on a CPU without AVX512-BF16 the error names that key
    from hybridflow.rollout.vllm_rollout import cpu_flags

    cfg = load_config(None, rl_overrides(tiny_model_dir, task_dir, tmp_path, "actor_rollout_ref.rollout.name=vllm",
                                         "actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16"), schema=HybridFlowConfig)
    if "avx512_bf16" not in cpu_flags():
        with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.fsdp_config\.mixed_precision=bf16: this CPU has no AVX512-BF16"):
            validate_config(cfg)


def test_vllm_generation_reflects_synced_weights(ray_cluster, vllm_model_dir, task_dir, tmp_path):
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.data.dataset import SFTDataset, collate_sft
    from hybridflow.data.tasks import write_parquet
    from hybridflow.trainer.rl import PROMPT_KEYS, RLTrainer

    cfg = load_config(None,
                      rl_overrides(vllm_model_dir, task_dir, tmp_path, "actor_rollout_ref.rollout.name=vllm",
                                   "actor_rollout_ref.actor.optim.lr=1e-2"), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        trainer.init_workers()
        prompts = trainer.collate([trainer.val_ds[i] for i in range(8)])
        greedy = trainer._sampling(greedy=True)
        before = trainer.actor.generate_sequences(prompts.select(PROMPT_KEYS), greedy)["responses"]

        # Teach the trained weights a constant answer "7" (real SFT steps on the FSDP2 actor).
        rows = [{"prompt": trainer.val_ds[i]["raw_prompt"], "response": "7"} for i in range(16)]
        write_parquet(rows, tmp_path / "sevens.parquet")
        sft = SFTDataset([str(tmp_path / "sevens.parquet")], trainer.tokenizer, max_length=40)
        batch = collate_sft([sft[i] for i in range(16)])
        for _ in range(30):
            trainer.actor.sft_step(batch)

        stale = trainer.actor.generate_sequences(prompts.select(PROMPT_KEYS), greedy)["responses"]
        assert torch.equal(stale, before)  # vLLM still generates with the old weights
        trainer.actor.reshard()
        after = trainer.actor.generate_sequences(prompts.select(PROMPT_KEYS), greedy)
        seven = trainer.tokenizer.encode("7", add_special_tokens=False)[0]
        assert (after["responses"][:, 0] == seven).all()  # the first generation after the sync uses the new weights
        assert not torch.equal(after["responses"], before)

        # Request-level generation through the worker group: greedy completions = the batch rows
        from hybridflow.protocol import Batch
        from hybridflow.rollout.base import batch_requests

        got = trainer.actor.generate_requests(Batch.from_dict(non_tensors={"request": batch_requests(prompts, greedy)}))["completion"]
        assert [list(c.token_ids) for c in got] == [after["responses"][i, : int(after["response_mask"][i].sum())].tolist() for i in range(8)]
    finally:
        trainer.shutdown()


def test_vllm_tensor_parallel_2_inside_the_workers(ray_cluster, vllm_model_dir, task_dir, varied_reward, tmp_path):
    """vLLM TP=2 through its external launcher: the engine runs inside the 2 actor workers over
    their process group (one replica, both ranks generate the same prompts); its log-probs match
    the FSDP2 trainer's in fp32 and the weights it generates with follow every update."""
    cfg = load_config(None,
                      rl_overrides(vllm_model_dir, task_dir, tmp_path, "actor_rollout_ref.rollout.name=vllm", f"custom_reward_function.path={varied_reward}",
                                         "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.total_training_steps=2"), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        hist = [h for h in trainer.fit()["history"] if h["step"] > 0]
    finally:
        trainer.shutdown()
    assert len(hist) == 2
    # Bytes received per rank: the engine's minimal pieces, not whole tensors. By hand: FSDP2 on 2
    # ranks shards each TP-sharded weight along its TP dim, so rank r already holds its vLLM TP
    # slice (vLLM's TP groups are consecutive ranks: rank r is TP rank r) and receives nothing of
    # it; the tensors vLLM takes whole (norms; the vocab tables, which vLLM pads per partition)
    # arrive whole, less the half the rank holds.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    whole = [p for n, p in model.named_parameters() if "norm" in n or "embed_tokens" in n or "lm_head" in n]
    expected = max(sum((p.numel() - p.chunk(2)[r].numel()) * 4 for p in whole) for r in range(2))
    for h in hist:
        assert h["rollout/logprob_diff_max"] < 1e-3  # vLLM TP=2 vs the FSDP2 trainer, fp32, after each sync
        assert abs(h["actor/ppo_kl"]) < 1e-6
        assert h["reshard/bytes_per_rank"] == h["reshard/min_bytes_per_rank"] == expected, h
        assert h["reshard/bytes_per_rank"] < h["reshard/naive_bytes_per_rank"]


def test_vllm_multi_turn_grpo_step(ray_cluster, vllm_model_dir, tmp_path):
    """The agent loop's requests on vLLM: turns answered by the guess environment, its tokens masked,
    vLLM's log-probs of the model tokens equal the trainer's recomputation, first ppo_kl exactly 0."""
    from hybridflow.data.tasks import write_parquet
    from test_e2e_agent import GUESS_STOPS, _guess_rows

    write_parquet(_guess_rows(16, 0), tmp_path / "train.parquet")
    write_parquet(_guess_rows(8, 1), tmp_path / "val.parquet")
    cfg = load_config(None, rl_overrides(vllm_model_dir, tmp_path, tmp_path / "out", "actor_rollout_ref.rollout.name=vllm",
                                         "data.max_prompt_length=64", "data.max_response_length=96", "trainer.total_training_steps=1",
                                         "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.multi_turn.enable=true",
                                         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
                                         f"actor_rollout_ref.rollout.stop_token_ids=[{GUESS_STOPS}]",
                                         "actor_rollout_ref.actor.recompute_old_log_prob=true"), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        out = trainer.fit()
        trajs = trainer.agent.last
    finally:
        trainer.shutdown()
    step = next(h for h in out["history"] if h["step"] == 1)
    assert step["actor/ppo_kl"] == 0.0
    assert step["agent/num_turns/max"] >= 2 and step["agent/tool_tokens/mean"] > 0
    assert step["rollout/logprob_diff_max"] < 1e-3  # model tokens only: the env's tokens have no rollout log-prob
    assert any(0 in t.response_mask[:max(i for i, m in enumerate(t.response_mask) if m) + 1] for t in trajs)


def test_vllm_serves_a_lora_adapter_with_the_trainers_log_probs(vllm_model_dir, tmp_path):
    """A PEFT adapter in the format `hybridflow export` writes for a LoRA run, served by vLLM's LoRA
    support (enable_lora + a LoRARequest) on the base: its greedy tokens' log-probs equal the HF model
    with the same adapter (fp32) to 1e-3, and the adapter changes what the base would say."""
    import os

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from hybridflow.config.schema import ModelConfig
    from hybridflow.models.lora import lora_config
    from hybridflow.rollout.vllm_rollout import VLLM_ENV

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32),
                                lora_config(ModelConfig(path=str(vllm_model_dir), lora_rank=8, lora_alpha=16)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(tmp_path / "adapter")

    for k, v in {**VLLM_ENV, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=str(vllm_model_dir), dtype="float32", enforce_eager=True, max_model_len=64, seed=0, enable_lora=True, max_lora_rank=8,
              logprobs_mode="processed_logprobs", gpu_memory_utilization=0.5)
    prompts = [[5, 17, 42, 99, 3], [60, 61, 62, 63, 64, 65, 66]]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)
    with_adapter = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=LoRARequest("trained", 1, str(tmp_path / "adapter")))
    base = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in with_adapter] != [o.outputs[0].token_ids for o in base]
    peft_model.eval()
    with torch.no_grad():
        for prompt, out in zip(prompts, with_adapter):
            toks = list(out.outputs[0].token_ids)
            ids = torch.tensor([prompt + toks])
            logp = torch.log_softmax(peft_model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
            hf = logp[torch.arange(len(toks)), torch.tensor(toks)]
            assert toks == logp.argmax(-1).tolist()  # vLLM's greedy tokens are the adapter model's
            vllm_lp = torch.tensor([lp[t].logprob for t, lp in zip(toks, out.outputs[0].logprobs)])
            assert (vllm_lp - hf).abs().max().item() < 1e-3


def test_vllm_rollout_generates_with_the_synced_lora_adapters(ray_cluster, vllm_model_dir, task_dir, varied_reward, tmp_path):
    """LoRA with the vLLM backend: the base is loaded once, each later sync moves the adapters alone and
    vLLM serves them as a LoRA request; its log-probs equal the FSDP2 trainer's (base + adapters) after
    every sync, in fp32, while the adapters move the policy (step 2's KL to the base is > 0)."""
    cfg = load_config(None,
                      rl_overrides(vllm_model_dir, task_dir, tmp_path, "actor_rollout_ref.rollout.name=vllm", f"custom_reward_function.path={varied_reward}",
                                         "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                                         "actor_rollout_ref.actor.use_kl_loss=true",
                                         "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.total_training_steps=3"), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        hist = [h for h in trainer.fit()["history"] if h["step"] > 0]
        plan = trainer.plan_summary
    finally:
        trainer.shutdown()
    assert len(hist) == 3
    for h in hist:
        assert h["rollout/logprob_diff_max"] < 1e-3, h  # vLLM with the adapter request vs the trainer
    # measured: KL to the base 0.0076 and 0.0116 at steps 2 and 3 (a mean |log-ratio| far above 1e-3), log-prob diff 4.8e-7:
    # a vLLM still serving the base (or stale adapters) would fail the 1e-3 check above
    assert hist[0]["actor/kl_loss"] == 0.0 and min(h["actor/kl_loss"] for h in hist[1:]) > 1e-3
    for h in hist[1:]:  # after the first switch: the adapters alone
        assert h["reshard/bytes_per_rank"] == max(plan["min_bytes_per_rank"]) < max(plan["first_switch_bytes_per_rank"])


def test_vllm_reports_behaviour_and_untruncated_log_probs(vllm_model_dir):
    """The vLLM backend's two log-probs at top-p 0.8 / top-k 8, against a plain HF forward pass put
    through the truncation by hand: the behaviour one (vLLM's processed log-probs: the truncated,
    renormalised distribution) and the untruncated one (its scoring pass; temperature alone), at
    temperature 1 (raw prompt log-probs) and 1.3 (the whole vocabulary, rescaled)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.protocol import Request, SamplingParams
    from hybridflow.rollout.vllm_rollout import VLLMRollout
    from test_rollout_requests import _truncated_logprob

    tok = AutoTokenizer.from_pretrained(vllm_model_dir)
    rollout = VLLMRollout(str(vllm_model_dir), "float32", 64, 0, "cpu", 0.5, 1, tokenizer=tok)
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()
    reqs = [Request(tok.encode(t), SamplingParams(max_new_tokens=8, temperature=temperature, top_p=0.8, top_k=8, seed=5))
            for temperature in (1.0, 1.3) for t in ("max 3 8 1", "max 9 2 7", "max 1 1 4")]
    gaps = []
    with torch.no_grad():
        for r, c in zip(reqs, rollout.generate_requests(reqs)):
            temperature = r.params.temperature
            assert c.untruncated_log_probs is not None and len(c.untruncated) == len(c.log_probs) == len(c.token_ids) > 0
            full = torch.tensor([list(r.prompt_ids) + list(c.token_ids)])
            logits = model(input_ids=full).logits[0, len(r.prompt_ids) - 1 : -1].float() / temperature
            for t, tokid in enumerate(c.token_ids):
                assert c.untruncated[t] == pytest.approx(float(torch.log_softmax(logits[t], -1)[tokid]), abs=1e-3)
                assert c.log_probs[t] == pytest.approx(_truncated_logprob(logits[t], tokid, 0.8, 8), abs=1e-3)
                gaps.append(c.log_probs[t] - c.untruncated[t])
    assert max(gaps) > 1e-2  # the two meanings differ where the truncation cut mass


def test_vllm_as_the_async_rollout_pool_with_partial_rollout(ray_cluster, vllm_model_dir, task_dir, varied_reward, tmp_path):
    """vLLM as the generation-only rollout of async rollout: one engine in the rollout pool's worker,
    the weights received from the actor's pool through the object store after every update, and
    partial rollout (every response in 2-token segments: the second segment continues from the
    first's tokens, vLLM's prefix cache holding them). At max_staleness=0 every token is sampled by
    the weights the trainer holds, so every step compares vLLM's log-probs (both segments) with the
    FSDP2 trainer's recomputation, in fp32, right after a cross-pool sync."""
    cfg = load_config(None, rl_overrides(vllm_model_dir, task_dir, tmp_path, "actor_rollout_ref.rollout.name=vllm",
                                         f"custom_reward_function.path={varied_reward}", "trainer.async_rollout=true",
                                         "async_training.max_staleness=0", "async_training.partial_rollout=true",
                                         "async_training.partial_rollout_chunk=2", "resource_pool.pools.actor_pool.workers_per_node=2",
                                         "resource_pool.pools.rollout_pool.workers_per_node=1", "resource_pool.mapping.actor_rollout=actor_pool",
                                         "resource_pool.mapping.rollout=rollout_pool"), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        hist = [h for h in trainer.fit()["history"] if h["step"] > 0]
    finally:
        trainer.shutdown()
    assert len(hist) == 3
    for h in hist:
        assert h["rollout/staleness_max"] == 0.0
        assert h["rollout/logprob_diff_max"] < 1e-3, h  # vLLM on its own pool vs the FSDP2 trainer, fp32, after each sync
        assert abs(h["actor/ppo_kl"]) < 1e-6


def test_openai_endpoint_on_vllm_records_what_vllm_samples_for_the_same_seed(tmp_path):
    """The agent endpoint (agent/openai_server.py) in front of the vLLM backend, driven by the
    official `openai` client with tools, logprobs and top_logprobs: the token ids, log-probs and top
    log-probs it returns and records equal vLLM's own `generate_requests` for the same prompt ids,
    params and seed."""
    import asyncio

    import openai
    from transformers import AutoTokenizer

    from hybridflow.agent.loop import RequestBatcher
    from hybridflow.agent.openai_server import EndpointSettings, LiveEndpoint
    from hybridflow.protocol import Request, SamplingParams
    from hybridflow.rollout.vllm_rollout import VLLMRollout

    from hybridflow.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", hidden_size=64, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rollout = VLLMRollout(str(model_dir), "float32", 1024, 0, "cpu", 0.5, 1, tokenizer=tok)  # the tool prompt is ~550 tokens
    calc = {"type": "function", "function": {"name": "calculator", "description": "calc", "parameters": {"type": "object", "properties": {}}}}
    base = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11, top_logprobs=2)

    async def body():
        batcher = RequestBatcher(rollout.generate_requests, SamplingParams(max_new_tokens=64, seed=1))
        ep = LiveEndpoint(EndpointSettings("tiny", 64, 900, sampling="request"), tok, batcher)
        async with ep.serve():
            s = ep.open_session()
            async with openai.AsyncOpenAI(base_url=ep.url(s), api_key=s.key, max_retries=0) as client:
                r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is 2*3?"}], tools=[calc],
                                                         logprobs=True, top_logprobs=2, seed=11, max_tokens=24, temperature=1.0)
        return r, s

    r, session = asyncio.run(body())
    want = rollout.generate_requests([Request(r.model_extra["prompt_token_ids"], base)])[0]
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == list(want.token_ids) and len(want.token_ids) > 0
    assert [t.logprob for t in choice.logprobs.content] == list(want.log_probs)
    tops = [[e.logprob for e in t.top_logprobs] for t in choice.logprobs.content]
    assert tops == [[lp for _, lp in top] for top in want.top_logprobs] and all(len(t) == 2 and t[0] >= t[1] for t in tops)
    for t, lp, top in zip(want.token_ids, want.log_probs, want.top_logprobs):  # the sampled token, where listed, has its own log-prob
        assert lp <= top[0][1] and all(v == lp for i, v in top if i == t)
    assert session.trajectory().response_ids == list(want.token_ids) and session.trajectory().log_probs == list(want.log_probs)


def test_mismatch_doctor_on_vllm_shows_the_difference_per_layer(vllm_model_dir):
    """`hybridflow mismatch` on a vLLM run replays through vLLM itself: per probe (embedding, every
    decoder layer, the final norm, the head) vLLM's activation against the trainer's forward on the
    tokens vLLM sampled. The same fp32 weights on both sides: the embedding is a lookup (equal bit for
    bit), the layers differ at rounding level (vLLM's own kernels) and no layer is named; with only
    vLLM's copy of layer 1 nudged the doctor names layer 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.protocol import SamplingParams
    from hybridflow.utils.mismatch import diagnose_vllm, vllm_backend

    tok = AutoTokenizer.from_pretrained(vllm_model_dir)
    train = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()
    gen = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()
    prompts = [tok.encode(t) for t in ("max 3 8 1", "max 9 2 7", "max 1 1 4")]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    backend = vllm_backend(gen, tok, max_model_len=64)  # one engine for both replays (vLLM's state is process-global)
    report = diagnose_vllm(train, gen, tok, prompts, params, backend=backend)
    print(report.table())
    names = [p.name for p in report.probes]
    assert names[0] == "model.embed_tokens" and names[-1] == "lm_head" and len(names) == train.config.num_hidden_layers + 3
    assert report.probes[0].max == 0.0  # the same rows of the same table
    assert all(0 <= p.max < 1e-3 * max(1.0, p.scale) for p in report.probes)  # rounding level, not a wrong weight
    assert report.named is None and report.logprob_max < 1e-3
    with torch.no_grad():
        gen.model.layers[1].mlp.down_proj.weight.mul_(1.05)
    nudged = diagnose_vllm(train, gen, tok, prompts, params, backend=backend)  # the nudged weights loaded into it
    print(nudged.table())
    assert nudged.named == "model.layers.1", nudged.table()
