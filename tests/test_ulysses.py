"""Ulysses sequence parallelism (`hybridflow/parallel/ulysses.py`, actor.ulysses_sequence_parallel_size).

- sp2 (FSDP2 over both ranks, the sequence split in two) equals one process on a 5,001-token packed
  micro-batch of 3 sequences: the per-token log-probs and entropies of `TrainEngine.log_probs`, the
  loss, and every parameter's gradient before any optimizer step, through the chunked head and the
  plain logits pass. Oracle: a plain HF forward (padded rows, transformers' own sdpa mask) of the
  same checkpoint in float64, computed in each process. Tolerance: sp2 (fp32) may be at most 4x
  further from the float64 oracle than the single-process fp32 HF forward is, plus 1e-6 of the
  tensor's scale (where the fp32 error is near 0): fp32's rounding over a ~2.4k-token softmax and
  ~64-wide dot products sets the reference's own error (~1e-6 here), and a different but exact
  summation order (per-sequence attention, head blocks, chunked head) changes it by a small factor;
  a wrong slice, position id, mask or gradient scale gives errors of order 1 instead.
- bad input names the key before any worker starts; the dispatch gives the sp ranks the same rows.
"""

from __future__ import annotations

import os
import sys

import pytest
from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT, RESP = 1500, 900
PROMPT_LENS, RESP_LENS = (1500, 700, 1100), (900, 500, 301)  # 2,400 + 1,200 + 1,401 = 5,001 valid tokens (odd: one pad token at sp2)


def _batch(vocab: int, seed: int = 0):
    """A left-padded prompt + right-padded response micro-batch [3, P+R] (verl's layout) with
    advantages [3, R] for a PPO-like token loss."""
    import torch

    from hybridflow.protocol import Batch

    g = torch.Generator().manual_seed(seed)
    b = len(PROMPT_LENS)
    ids = torch.randint(3, vocab, (b, PROMPT + RESP), generator=g)
    mask = torch.zeros(b, PROMPT + RESP, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESP_LENS)):
        mask[i, PROMPT - p : PROMPT + r] = 1
    ids = ids * mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, PROMPT:],
                                    "response_mask": mask[:, PROMPT:].float(), "advantages": torch.randn(b, RESP, generator=g)})


def _loss(logp, ent, mb):
    """A PPO-like token loss: -(A * log p) and an entropy bonus, mean over the response tokens."""
    m = mb["response_mask"].to(logp.dtype)
    return (-(mb["advantages"].to(logp.dtype) * logp) - 0.01 * ent).mul(m).sum() / m.sum()


def _oracle(path: str, batch, dtype):
    """(log-probs [b, R], entropies [b, R], loss, {name: grad}) from a plain HF forward in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(dtype)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"], use_cache=False)
    logits = out.logits[:, PROMPT - 1 : -1]  # [b, R, V] predicting the response tokens
    lsm = torch.log_softmax(logits, -1)
    logp = lsm.gather(-1, batch["responses"][..., None]).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    loss = _loss(logp, ent, batch)
    loss.backward()
    return logp.detach(), ent.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _check(name: str, got, ref32, ref64, out: dict) -> None:
    import torch

    got, ref32, ref64 = got.double(), ref32.double(), ref64.double()
    err, base = float((got - ref64).abs().max()), float((ref32 - ref64).abs().max())
    bound = 4 * base + 1e-6 * float(ref64.abs().max())
    out[name] = (err, base)
    assert err <= bound, f"{name}: sp2 vs float64 {err:.3g} > {bound:.3g} (single-process fp32 vs float64 {base:.3g})"
    assert torch.isfinite(got).all()


def _sp_worker(rank: int, world: int, port: int, path: str, result: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    from conftest import join_gloo

    join_gloo(rank, world, port)
    sys.path.insert(0, ROOT)
    from torch.distributed.tensor import DTensor

    from hybridflow.config.schema import FSDPConfig, OptimConfig
    from hybridflow.engine.train_engine import TrainEngine
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.parallel.layout import train_mesh
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    layout = ParallelDims.for_world(world, sp=2)
    dp_i, dp, _ = layout.dispatch(rank)  # world 4: two data ranks, each its own micro-batch over an sp pair
    # The first rank of each sp group checks its data rank's log-probs and loss (the others hold the
    # same, gathered); rank 0 also every gradient (FSDP2 averages over the data ranks: the reference
    # is the mean of theirs), so it computes every data rank's oracle.
    checks = rank % layout.sp == 0
    mine = range(dp) if rank == 0 else [dp_i] if checks else []
    refs = {dtype: {d: _oracle(path, _batch(model.config.vocab_size, seed=d), dtype) for d in mine} for dtype in (torch.float64, torch.float32)}
    batch = _batch(model.config.vocab_size, seed=dp_i)

    engine = TrainEngine(model, train_mesh(layout, "cpu"), "cpu", FSDPConfig(), optim=OptimConfig(lr=1e-3), remove_padding=True, logits_chunk=256)
    out: dict = {}
    m = batch["response_mask"].bool()
    for chunk in (256, None):  # the chunked head (the workers' default) and the plain logits pass
        engine.logits_chunk = chunk
        lp, ent = engine.log_probs(batch, micro_batch_size=3, with_entropy=True)
        if checks:
            (lp64, ent64, *_), (lp32, ent32, *_) = refs[torch.float64][dp_i], refs[torch.float32][dp_i]
            _check(f"logprob/{chunk}", lp[m], lp32[m], lp64[m], out)
            _check(f"entropy/{chunk}", ent[m], ent32[m], ent64[m], out)

    losses = []
    engine.logits_chunk = 256
    engine.forward_backward(batch, lambda lp, ent, mb: losses.append(_loss(lp, ent, mb)) or losses[-1], micro_batch_size=3)
    if checks:
        _check("loss", losses[0].detach(), refs[torch.float32][dp_i][2], refs[torch.float64][dp_i][2], out)
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in engine.module.named_parameters()}  # a collective
    if rank == 0:
        g64, g32 = ({n: sum(r[3][n] for r in refs[dtype].values()) / dp for n in grads} for dtype in (torch.float64, torch.float32))
        for n, g in grads.items():
            _check(f"grad/{n}", g, g32[n], g64[n], out)
    if rank == 0:
        with open(result, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    from hybridflow.models.tiny import make_tiny_model

    # 4 attention heads, 2 KV heads (GQA): sp2 leaves 2 query heads and 1 KV head per rank
    return make_tiny_model(tmp_path_factory.mktemp("sp") / "m", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, max_position_embeddings=4096)


def test_sp2_equals_one_process_on_5k_tokens(tiny_long, tmp_path):
    import json

    import torch.multiprocessing as mp

    result = tmp_path / "sp.json"
    mp.spawn(_sp_worker, args=(2, free_port(), str(tiny_long), str(result)), nprocs=2)
    out = json.loads(result.read_text())
    assert {"loss", "logprob/256", "logprob/None", "entropy/256"} <= set(out) and sum(k.startswith("grad/") for k in out) >= 10


SP = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"


def _config(tmp_path, model: dict, overrides: list[str]):
    import json

    from hybridflow.config import load_config

    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps({"max_position_embeddings": 64, "num_hidden_layers": 2, **model}))
    for name in ("train.parquet", "val.parquet"):
        (tmp_path / name).write_text("")
    return load_config(os.path.join(ROOT, "configs", "grpo_tiny.yaml"), [
        f"actor_rollout_ref.model.path={tmp_path / 'model'}", f"data.train_files=[{tmp_path / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'val.parquet'}]", "trainer.n_gpus_per_node=4", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", *overrides])


@pytest.mark.parametrize("model, overrides, expected", [
    ({"num_attention_heads": 6, "num_key_value_heads": 6}, [f"{SP}=4"], f"{SP}=4 must divide the model's num_attention_heads (6)"),
    ({"num_attention_heads": 4, "num_key_value_heads": 1}, [f"{SP}=2"], f"{SP}=2 must divide the model's num_key_value_heads (1)"),
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, [f"{SP}=3"], f"{SP}=3 must divide the actor's 4 workers"),
    ({"num_attention_heads": 4, "num_key_value_heads": 2}, [f"{SP}=2", "actor_rollout_ref.actor.tensor_model_parallel_size=2"],
     f"{SP}=2 needs actor_rollout_ref.actor.tensor_model_parallel_size=1"),
    ({"num_attention_heads": 4, "num_key_value_heads": 2}, [f"{SP}=0"], f"{SP} must be a positive integer, got 0"),
])
def test_bad_sp_is_refused_naming_the_key(tmp_path, model, overrides, expected):
    from hybridflow.config import ConfigError
    from hybridflow.config.validate import validate_config

    with pytest.raises(ConfigError) as e:
        validate_config(_config(tmp_path, model, overrides))
    assert expected in str(e.value), str(e.value)


def test_sp_groups_share_rows_and_batch_sizes_count_data_ranks(tmp_path):
    """sp2 on 4 workers: 2 data ranks; the sp ranks of a group get the same chunk, the first returns
    it; the PPO mini-batch is per data rank (8 prompts x n over 2, not 4); the reference shares the layout."""
    from hybridflow.config.derive import derive_defaults
    from hybridflow.config.validate import validate_config
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.run_plan import resolve

    cfg = _config(tmp_path, {"num_attention_heads": 4, "num_key_value_heads": 2}, [f"{SP}=2"])
    validate_config(cfg)
    derive_defaults(cfg)
    spec = resolve(cfg).actor
    lay = spec.layout
    assert (lay.sp, lay.dp, lay.data_parallel, lay.label) == (2, 4, 2, "sp2xdp4")
    assert ParallelDims.parse(lay.label).with_gen(lay.gen_tp, procs_per_node=lay.procs_per_node) == lay
    assert [lay.dispatch(r) for r in range(4)] == [(0, 2, True), (0, 2, False), (1, 2, True), (1, 2, False)]
    n = cfg.actor_rollout_ref.rollout.n
    assert spec.update_plan(lay.data_parallel).mini_rows == 8 * n // 2


def test_planner_divides_activations_by_sp_and_searches_sp_where_dp_does_not_fit():
    """memory_plan: a rank holds seq_len / sp tokens of activations (each through the head); the
    search offers sp layouts and ranks the smallest sp that fits first among equal switches."""
    import dataclasses

    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import GIB, Cluster, MemoryInputs, layer_activation_bytes, memory_plan, norm_bytes, plan_for
    from hybridflow.planning.search import search

    arch, m = load_arch("qwen2.5-7b"), MemoryInputs(seq_len=16384, response_len=15360, rollout_seqs=16, logits_chunk=None)
    acts = {}
    for sp in (1, 2, 4):
        lay = ParallelDims.for_world(8, sp=sp)
        acts[sp] = memory_plan(plan_for(arch, lay, 1, 2), arch, lay, m, 0)["activations"]

    def backbone(tokens: int, attention: str) -> int:  # the decoder layers' saved tensors and the final norm's (planning/cost.py)
        return arch.layers * layer_activation_bytes(arch, 1, tokens, 2, attention=attention) + tokens * (norm_bytes(arch.hidden, 2) + 2 * arch.hidden)

    assert acts[1] == backbone(16384, "sdpa") + 2 * 15360 * arch.vocab * 4  # plain logits: the response positions
    for sp in (2, 4):  # the rank's tokens through Ulysses' attention (no mask), every local position through the head
        assert acts[sp] == backbone(16384 // sp, "ulysses") + 2 * (16384 // sp) * arch.vocab * 4
    assert acts[2] / acts[1] < 0.5 and acts[4] / acts[1] < 0.25  # at least 1 / sp: SDPA's padding-mask row per token goes too
    ranked, invalid = search(arch, Cluster(gpus_per_node=8), dataclasses.replace(m, logits_chunk=1024), gen_tps=[4])  # the default chunked head
    fits = {r["train_layout"] for r in ranked}
    assert "dp8" not in fits and {"sp2xdp8", "sp4xdp8"} <= fits and any("dp8" == i.train_layout and "does not fit" in i.reason for i in invalid)
    assert [r["sp"] for r in ranked if r["train_layout"].startswith("sp")] == [2, 4]  # the smaller sp first
    assert any(i.train_layout == "sp8xdp8" and "does not divide the 28 attention heads" in i.reason for i in invalid)
    assert max(r["memory_per_rank_bytes"] for r in ranked) <= 80 * GIB


if __name__ == "__main__":  # sp2 x fsdp2 (4 processes, 2 data ranks): .venv/bin/python tests/test_ulysses.py 4
    import json
    import tempfile

    import torch.multiprocessing as mp

    from hybridflow.models.tiny import make_tiny_model

    world, tmp = int(sys.argv[1]) if len(sys.argv) > 1 else 2, tempfile.mkdtemp()
    path = make_tiny_model(os.path.join(tmp, "m"), hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                           max_position_embeddings=4096)
    mp.spawn(_sp_worker, args=(world, free_port(), str(path), os.path.join(tmp, "r.json")), nprocs=world)
    for k, (err, base) in json.load(open(os.path.join(tmp, "r.json"))).items():
        print(f"{k:55s} sp vs float64 {err:.3g}   one-process fp32 vs float64 {base:.3g}")
