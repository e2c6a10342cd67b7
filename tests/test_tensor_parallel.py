"""Generation tensor parallelism: the shard-dim table, TP == unsharded (logits and greedy ids), and
FSDP2 training shards aligned with the generation TP dims. Multi-rank checks spawn gloo processes."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from hybridflow.parallel.tensor_parallel import gen_ranks, gen_shard_dim, validate_gen_tp
from conftest import free_port

PROMPTS = ["hello world, how are you?", "hi", "1+2="]


# ---------------------------------------------------------------- the table (no processes)
@pytest.mark.parametrize("name, tied, dim", [
    ("model.layers.0.self_attn.q_proj.weight", False, 0),
    ("model.layers.0.self_attn.q_proj.bias", False, 0),
    ("model.layers.1.self_attn.k_proj.bias", True, 0),
    ("model.layers.0.self_attn.v_proj.weight", False, 0),
    ("model.layers.0.mlp.gate_proj.weight", False, 0),
    ("model.layers.0.mlp.up_proj.weight", True, 0),
    ("model.layers.0.self_attn.o_proj.weight", False, 1),
    ("model.layers.0.self_attn.o_proj.bias", False, None),
    ("model.layers.0.mlp.down_proj.weight", True, 1),
    ("model.embed_tokens.weight", False, 0),
    ("model.embed_tokens.weight", True, None),
    ("lm_head.weight", False, 0),
    ("lm_head.weight", True, None),
    ("model.norm.weight", False, None),
    ("model.layers.0.input_layernorm.weight", False, None),
    ("model.rotary_emb.inv_freq", False, None),
    ("_orig_mod.model.layers.3.self_attn.q_proj.weight", False, 0),
    ("weight", False, None),
    # LoRA (peft names): the base follows its module; B [out, r] splits with a colwise module, A [r, in] with a rowwise one
    ("model.layers.0.self_attn.q_proj.base_layer.weight", False, 0),
    ("model.layers.0.self_attn.q_proj.base_layer.bias", False, 0),
    ("model.layers.0.self_attn.q_proj.lora_A.default.weight", False, None),
    ("model.layers.0.self_attn.q_proj.lora_B.default.weight", False, 0),
    ("model.layers.0.mlp.down_proj.base_layer.weight", False, 1),
    ("model.layers.0.mlp.down_proj.lora_A.default.weight", False, 1),
    ("model.layers.0.mlp.down_proj.lora_B.default.weight", False, None),
])
def test_gen_shard_dim(name, tied, dim):
    assert gen_shard_dim(name, tied) == dim


def test_gen_ranks_and_validate():
    # N=4, gen_tp=2 -> k=2: TP index r // 2, DP index r % 2; TP groups {0, 2}, {1, 3}
    assert [gen_ranks(r, 4, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [gen_ranks(r, 4, 4) for r in range(4)] == [(r, 0) for r in range(4)]
    assert [gen_ranks(r, 4, 1) for r in range(4)] == [(0, r) for r in range(4)]
    assert validate_gen_tp(2, 4, 8, 2) == []
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    (msg,) = validate_gen_tp(3, 4, 6, 3)
    assert key in msg and "must divide the number of actor workers (4" in msg and "[1, 2, 4]" in msg
    (msg,) = validate_gen_tp(4, 4, 8, 2)
    assert "num_key_value_heads (2)" in msg and "[1, 2]" in msg
    assert "must be an integer >= 1" in validate_gen_tp(0, 4, 8, 2)[0]


# ---------------------------------------------------------------- multi-rank (spawned gloo processes)
def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _check_tp(rank, world, gen_tp, path):
    """TP copy == unsharded model (logits on a left-padded batch, greedy ids); shards = FSDP groups."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoTokenizer

    from hybridflow.parallel.tensor_parallel import apply_tensor_parallel, gen_mesh, gen_shard_dims

    k = world // gen_tp
    mesh = gen_mesh("cpu", world, gen_tp)
    tp_mesh = mesh["tp"]
    assert tp_mesh.mesh.tolist() == list(range(rank % k, world, k))  # strided TP group
    assert gen_ranks(rank, world, gen_tp) == (tp_mesh.get_local_rank(), mesh["dp"].get_local_rank())

    ref, model = _load(path), _load(path)
    full = {n: p.detach().clone() for n, p in ref.named_parameters()}
    apply_tensor_parallel(model, tp_mesh)
    t = tp_mesh.get_local_rank()
    for name, dim in gen_shard_dims(model).items():
        p = dict(model.named_parameters())[name]
        if dim is None:
            assert not isinstance(p, DTensor), name
            continue
        # generation TP rank t holds FSDP slices t*k .. t*k+k-1 along the same dim (the resharding invariant)
        want = torch.cat(torch.chunk(full[name], world, dim=dim)[t * k:(t + 1) * k], dim=dim)
        assert torch.equal(p.to_local(), want), name
    assert any(isinstance(p, DTensor) for p in model.parameters())

    tok = AutoTokenizer.from_pretrained(path)
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    assert tok.padding_side == "left" and (batch["attention_mask"][:, 0] == 0).any()
    with torch.no_grad():
        want_logits = ref(**batch).logits
        got_logits = model(**batch).logits
        assert type(got_logits) is torch.Tensor and got_logits.shape == want_logits.shape
        m = batch["attention_mask"].bool()
        diff = (got_logits[m] - want_logits[m]).abs().max().item()
        assert diff < 1e-5, (path, gen_tp, diff)
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        want_ids = ref.generate(**batch, **kw)
        got_ids = model.generate(**batch, **kw)
    assert torch.equal(got_ids, want_ids), (path, gen_tp)


def _check_fsdp(rank, world, path):
    """FSDP2 shards each parameter along its generation dim; forward + backward + AdamW run."""
    from torch.distributed.tensor import DTensor, Shard

    from hybridflow.parallel.fsdp import apply_fsdp2, make_mesh
    from hybridflow.parallel.tensor_parallel import fsdp_shard_placement_fn, gen_shard_dims

    model = _load(path).train()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    dims = gen_shard_dims(model)
    assert dims["model.layers.0.mlp.down_proj.weight"] == 1 and dims["model.layers.0.self_attn.q_proj.weight"] == 0
    ids = torch.randint(4, 99, (2, 10), generator=torch.Generator().manual_seed(0))
    ref_loss = model(input_ids=ids, labels=ids).loss.item()

    apply_fsdp2(model, make_mesh("cpu", world), shard_placement_fn=fsdp_shard_placement_fn(model))
    params = dict(model.named_parameters())
    assert params.keys() == full.keys()
    for name, p in params.items():
        dim = 0 if dims[name] is None else dims[name]
        assert isinstance(p, DTensor) and p.placements == (Shard(dim),), (name, p.placements)
        assert torch.equal(p.to_local(), torch.chunk(full[name], world, dim=dim)[rank]), name

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - ref_loss) < 1e-5
    loss.backward()
    grad = params["model.layers.0.mlp.down_proj.weight"].grad
    assert isinstance(grad, DTensor) and grad.placements == (Shard(1),)
    opt.step()
    after = params["model.layers.0.mlp.down_proj.weight"].to_local()
    assert after.shape == torch.chunk(full["model.layers.0.mlp.down_proj.weight"], world, dim=1)[rank].shape
    assert not torch.equal(after, torch.chunk(full["model.layers.0.mlp.down_proj.weight"], world, dim=1)[rank])
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def _worker(rank, world, port, layouts, paths, fsdp_path):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        for gen_tp in layouts:
            for path in paths:
                _check_tp(rank, world, gen_tp, path)
        _check_fsdp(rank, world, fsdp_path)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    """GQA models (8 heads, 4 KV heads: shardable at tp 2 and 4), vocab 259 (uneven vocab shards)."""
    from hybridflow.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tp_models")
    kw = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=128)
    return [str(make_tiny_model(root / "qwen2", arch="qwen2", **kw)),
            str(make_tiny_model(root / "llama", arch="llama", **kw)),
            str(make_tiny_model(root / "tied", arch="qwen2", tie_word_embeddings=True, seed=1, **kw))]


def _spawn(world, layouts, paths, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the untied qwen2 model for FSDP: it has q/k/v biases, a rowwise weight and a separate lm_head
    mp.spawn(_worker, args=(world, free_port(), layouts, paths, paths[0]), nprocs=world, join=True)


def test_tp_world2(tp_models, monkeypatch):
    _spawn(2, [2], tp_models, monkeypatch)


def test_tp_world4(tp_models, monkeypatch):
    _spawn(4, [2, 4], tp_models, monkeypatch)
