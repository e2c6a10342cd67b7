"""Routing replay (models/routing.py): the rollout records each token's experts, the trainer replays them.

Oracles are HF's own forwards: the router's top-k read from a full forward over prompt + response
(recorded ids), and a forward whose routers' forward is replaced by one that takes given ids
(replayed log-probs). The recorded ids come from the KV-cached generate and the oracle from one full
forward: fp32 sums in another order, so a near tie may legitimately go the other way; such a token
must be a near tie in the oracle (its recorded experts' probabilities within 1e-4 of the chosen).
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.models.tiny import make_tiny_model

E, K = 4, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("rr") / "qwen3_moe", arch="qwen3_moe", hidden_size=32, intermediate_size=64, num_experts=E)


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(tok, n: int = 4):
    from hybridflow.protocol import Batch
    from hybridflow.rollout.base import left_padded

    texts = ["max 3 8 1", "add 2 2", "sort 9 1 4 7", "x"][:n]
    input_ids, mask = left_padded([tok.encode(t, add_special_tokens=False) for t in texts], tok.pad_token_id)
    return Batch.from_dict(tensors={"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)})


def _router_outputs(model, batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """HF forward over the whole sequences: per layer (probs [b*T, E], top-k ids [b*T, k])."""
    from hybridflow.models.moe import routers

    outs, hooks = [], [r.register_forward_hook(lambda m, i, o: outs.append((torch.softmax(o[0].float(), -1), o[2]))) for r in routers(model)]
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    for h in hooks:
        h.remove()
    return outs


@pytest.mark.parametrize("continuous", [False, True])
def test_recorded_experts_are_the_routers_topk(moe_dir, continuous):
    from transformers import AutoTokenizer

    from hybridflow.protocol import SamplingParams
    from hybridflow.rollout.hf_rollout import HFRollout

    model, tok = _model(moe_dir), AutoTokenizer.from_pretrained(moe_dir)
    rollout = HFRollout(model, tok, "cpu", continuous=continuous, record_routes=True)
    out = rollout.generate(_prompts(tok), SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    routes = out["routed_experts"]  # [b, P+R, L, k]
    b, T = out["input_ids"].shape
    assert routes.shape == (b, T, 2, K) and routes.dtype == torch.int8
    mask = out["attention_mask"].bool()
    recorded = routes[..., 0, 0] >= 0  # [b, T]
    last = mask.long().cumsum(1).argmax(1)  # each row's last valid position: its last sampled token, never fed back
    expect = mask.clone()
    expect[torch.arange(b), last] = False
    assert torch.equal(recorded, expect)
    flips = 0
    for layer, (probs, ids) in enumerate(_router_outputs(model, out)):
        ids, probs = ids.view(b, T, K), probs.view(b, T, E)
        rec = routes[:, :, layer].long()
        same = (rec.sort(-1).values == ids.sort(-1).values).all(-1) | ~recorded
        for i, t in (~same).nonzero().tolist():  # a near tie in the oracle, else a wrong record
            assert (probs[i, t].gather(0, ids[i, t]).sum() - probs[i, t].gather(0, rec[i, t]).sum()).abs() < 1e-4, (layer, i, t)
            flips += 1
    assert flips <= 2


def _replay_batch(model, tok, forced_shift: int):
    """A scored batch (prompts + 4 response tokens) and routed_experts = the oracle's top-k + shift (mod E)."""
    from hybridflow.protocol import Batch

    p = _prompts(tok)
    b, P = p["input_ids"].shape
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(3, 60, (b, 4), generator=g)
    mask = torch.cat([p["attention_mask"], torch.ones(b, 4, dtype=torch.long)], 1)
    batch = Batch.from_dict(tensors={"input_ids": torch.cat([p["input_ids"], resp], 1), "attention_mask": mask,
                                     "position_ids": (mask.cumsum(1) - 1).clamp(min=0), "responses": resp})
    ids = torch.stack([o[1] for o in _router_outputs(model, batch)], dim=1).view(b, P + 4, -1, K)  # [b, T, L, k]
    forced = ((ids + forced_shift) % E).to(torch.int8)
    forced[:, :, :, :] = torch.where(mask.bool()[..., None, None], forced, torch.full_like(forced, -1))
    batch["routed_experts"] = forced
    return batch


def _forced_oracle(model, batch) -> torch.Tensor:
    """Response log-probs [b, R] from an HF forward whose routers' forward takes the given ids (valid tokens)."""
    import types

    from hybridflow.models.moe import routers

    R = batch["responses"].shape[1]
    valid = batch["attention_mask"].bool().reshape(-1)
    forced = batch["routed_experts"].long().reshape(-1, *batch["routed_experts"].shape[2:])  # [b*T, L, k]
    saved = []
    for layer, r in enumerate(routers(model)):
        def forward(self, h, layer=layer):
            logits = torch.nn.functional.linear(h.reshape(-1, self.hidden_dim), self.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            top_v, top_i = torch.topk(probs, self.top_k, dim=-1)
            top_i = torch.where(valid[:, None], forced[:, layer], top_i)
            top_v = probs.gather(1, top_i)
            return logits, (top_v / top_v.sum(-1, keepdim=True)).to(logits.dtype), top_i
        saved.append(r.forward)
        r.forward = types.MethodType(forward, r)
    try:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
    finally:
        for r, f in zip(routers(model), saved):
            r.forward = f
    return torch.log_softmax(logits[:, -R - 1:-1].float(), -1).gather(-1, batch["responses"][..., None])[..., 0]


@pytest.mark.parametrize("packed,chunk", [(False, None), (True, None), (False, 16), (True, 16)])
def test_replayed_experts_change_logprobs_as_an_hf_forward_with_them_forced(moe_dir, packed, chunk):
    from transformers import AutoTokenizer

    from hybridflow.engine.model import response_logprobs
    from hybridflow.models.routing import RouteReplayer, clear

    model, tok = _model(moe_dir), AutoTokenizer.from_pretrained(moe_dir)
    batch = _replay_batch(model, tok, forced_shift=1)
    with torch.no_grad():
        natural, _ = response_logprobs(model, batch.select(["input_ids", "attention_mask", "position_ids", "responses"]), remove_padding=packed,
                                       chunk=chunk)
        RouteReplayer(model)
        replayed, _ = response_logprobs(model, batch, remove_padding=packed, chunk=chunk)
    clear(model)  # the target stays set for a checkpointed layer's recomputation; the oracle's forward routes itself
    assert (replayed - natural).abs().max() > 1e-2  # other experts: other log-probs
    torch.testing.assert_close(replayed, _forced_oracle(model, batch), rtol=0, atol=1e-5)


def test_replay_off_and_replay_of_the_natural_experts_are_bit_for_bit(moe_dir):
    """No replayer: routed_experts in the batch change nothing; a replayer given the trainer's own top-k
    (or no routed_experts) gives exactly the natural log-probs (the weights are the router's own numbers)."""
    from transformers import AutoTokenizer

    from hybridflow.engine.model import response_logprobs
    from hybridflow.models.routing import RouteReplayer

    model, tok = _model(moe_dir), AutoTokenizer.from_pretrained(moe_dir)
    own = _replay_batch(model, tok, forced_shift=0)
    plain = own.select(["input_ids", "attention_mask", "position_ids", "responses"])
    other = _replay_batch(model, tok, forced_shift=1)
    with torch.no_grad():
        base, _ = response_logprobs(model, plain)
        assert torch.equal(response_logprobs(model, other)[0], base)  # replay off: the key is ignored
        RouteReplayer(model)
        assert torch.equal(response_logprobs(model, plain)[0], base)
        assert torch.equal(response_logprobs(model, own)[0], base)


def test_router_replay_refusals_name_the_key(moe_dir, tmp_path):
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.config.loader import ConfigError
    from hybridflow.config.validate import validate_config

    for name in ("train.parquet", "val.parquet"):
        (tmp_path / name).write_text("")
    dense = make_tiny_model(tmp_path / "dense", hidden_size=32, intermediate_size=64)
    base = [f"data.train_files=[{tmp_path / 'train.parquet'}]", f"data.val_files=[{tmp_path / 'val.parquet'}]", "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.router_replay.mode=R3"]
    validate_config(load_config(None, [*base, f"actor_rollout_ref.model.path={moe_dir}"], schema=HybridFlowConfig))
    for extra, needle in [([f"actor_rollout_ref.model.path={dense}"], "is dense"),
                          ([f"actor_rollout_ref.model.path={moe_dir}", "actor_rollout_ref.rollout.name=vllm"], "rollout.name=vllm does not")]:
        with pytest.raises(ConfigError) as e:
            validate_config(load_config(None, [*base, *extra], schema=HybridFlowConfig))
        lines = [line for line in str(e.value).splitlines() if "router_replay" in line]
        assert len(lines) == 1 and lines[0].strip(" -").startswith("actor_rollout_ref.actor.router_replay.mode=R3") and needle in lines[0], lines


def test_grpo_step_with_router_replay(ray_cluster, task_dir, tmp_path):
    """The trainer carries routed_experts from the rollout to the actor's old-log-prob and update passes
    (2 FSDP2 workers, HF rollout): one GRPO step runs with R3, the mismatch metric at rounding level."""
    from conftest import rl_overrides, train_and_read_metrics

    model = make_tiny_model(tmp_path / "m", arch="qwen3_moe", hidden_size=32, intermediate_size=64, num_experts=E)
    rows = train_and_read_metrics(rl_overrides(model, task_dir, tmp_path / "run", "trainer.total_training_steps=1", "algorithm.adv_estimator=grpo",
                                               "actor_rollout_ref.actor.router_replay.mode=R3"), tmp_path / "run")
    m = rows[-1]
    assert m["rollout/logprob_diff_max"] < 1e-4 and m["actor/ppo_kl"] == 0.0, m
    assert m["actor/router_replay/differs"] == 0.0, m  # fp32 on both sides: the trainer's own experts are the rollout's


def test_the_replayer_counts_the_tokens_whose_experts_it_changed(moe_dir):
    """`actor/router_replay/differs` (the old-log-prob pass's share): replayed (token, layer) pairs whose own
    top-k set is another than the recorded one. Oracle: the recorded ids are the forward's own (0 differ), all
    shifted by one expert (every valid pair differs: with k = 2 of E = 4, a shift never maps a pair onto itself),
    or shifted on the first row only (that row's valid tokens x layers)."""
    from transformers import AutoTokenizer

    from hybridflow.engine.model import response_logprobs
    from hybridflow.models.routing import RouteReplayer

    model, tok = _model(moe_dir), AutoTokenizer.from_pretrained(moe_dir)
    own, shifted = _replay_batch(model, tok, forced_shift=0), _replay_batch(model, tok, forced_shift=1)
    layers = own["routed_experts"].shape[2]
    valid = int(own["attention_mask"].sum()) * layers
    first_row = own.select(["input_ids", "attention_mask", "position_ids", "responses", "routed_experts"])
    first_row["routed_experts"] = torch.cat([shifted["routed_experts"][:1], own["routed_experts"][1:]])
    replayer = RouteReplayer(model)
    for batch, differing in ((own, 0), (shifted, valid), (first_row, int(own["attention_mask"][0].sum()) * layers)):
        with torch.no_grad():
            response_logprobs(model, batch)
        assert replayer.take_counts() == (valid, differing)
