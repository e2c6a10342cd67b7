"""`hybridflow plan`: parameter tables from config alone, 3D-layout boxes, the cost model by hand,
search reasons, calibration and the pre-flight memory check. (Predicted bytes == the engine's
measured bytes in every layout it runs: tests/test_hybrid_engine.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hybridflow.hybrid_engine.plan import ReshardPlan, intersect, volume
from hybridflow.parallel.dims import ParallelDims
from hybridflow.planning.arch import PRESETS, Arch, load_arch
from hybridflow.planning.cost import GIB, Cluster, MemoryInputs, plan_for, predict_switch, rows
from hybridflow.planning.search import search

F32 = 4


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_parameter_table_is_what_transformers_builds(preset):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(PRESETS[preset])
    hf = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == load_arch(preset).param_shapes()


def test_checkpoint_parameter_table(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridflow.models.tiny import make_tiny_model

    for path in (tiny_model_dir, make_tiny_model(tmp_path / "llama", arch="llama", hidden_size=64, num_attention_heads=4,
                                                  num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=True)):
        model = AutoModelForCausalLM.from_pretrained(path)
        assert {n: tuple(p.shape) for n, p in model.named_parameters()} == load_arch(str(path)).param_shapes()
    with pytest.raises(ValueError, match="neither a preset"):
        load_arch(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        Arch.from_config({"model_type": "gpt2", "num_attention_heads": 2})


LAYOUTS = ["dp4", "tp2xdp2", "pp2xdp2", "pp2xtp2", "tp4", "pp4", "pp2xtp2xdp1"]


@pytest.mark.parametrize("label", LAYOUTS)
def test_3d_training_boxes_partition_every_parameter_and_sit_inside_the_generation_box(label):
    """Every parameter's training boxes are a partition (replicas identical, others disjoint); the
    training box of a rank lies inside its generation box whenever gen_tp divides tp*dp (HybridFlow's
    grouping), so it receives exactly need - own; a generation slice is a sub-slice of the
    training one when tp*dp divides gen_tp."""
    layout = ParallelDims.parse(label)
    arch = Arch.from_config(dict(model_type="qwen2", hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                 intermediate_size=128, vocab_size=96))
    m = layout.tp * layout.dp
    for gen_tp in (1, 2, 4):
        if m % gen_tp and (gen_tp % m or layout.pp % (gen_tp // m)):
            continue
        plan = plan_for(arch, layout, gen_tp, F32)
        for p in plan.params:
            boxes = {b for b in p.own if volume(b)}
            assert sum(volume(b) for b in boxes) == math.prod(p.shape), (label, gen_tp, p.name)
            assert all(a == b or not intersect(a, b) for a in boxes for b in boxes)
            for r, (own, need) in enumerate(zip(p.own, p.need)):
                if not volume(own):
                    continue
                inside = volume(intersect(own, need)) == volume(own)
                contains = volume(intersect(own, need)) == volume(need)
                if p.gen_dim is not None and m % gen_tp == 0:
                    assert inside, (label, gen_tp, p.name, r)
                if p.gen_dim is not None and gen_tp % m == 0:
                    assert contains, (label, gen_tp, p.name, r)
        # every generation TP group (same DP index) holds each TP slice exactly once
        assert len({plan.params[1].need[r] for r in range(layout.world)}) == gen_tp


def test_pipeline_layout_bytes_by_hand():
    """pp2 x dp2, gen_tp 2, two layers of one [8, 4] column-parallel weight (fp32): rank r holds rows
    of its own stage's layer only (FSDP over dp along dim 0) and is generation TP index dp_i, so it
    lacks nothing of its own layer and all of its generation rows (4 x 4) of the other stage's."""
    shapes = {f"model.layers.{i}.self_attn.q_proj.weight": ((8, 4), F32, 0, 0) for i in range(2)}
    plan = ReshardPlan.build(shapes, 4, 2, layout=ParallelDims(pp=2, dp=2))
    assert [plan.min_bytes(r) for r in range(4)] == [16 * F32] * 4
    assert [plan.naive_bytes(r) for r in range(4)] == [(64 - 16) * F32] * 4
    assert plan.params[0].own[2] == ((0, 0), (0, 0)) and plan.params[1].own[2] == ((0, 4), (0, 4))
    with pytest.raises(ValueError, match="does not fit the training layout"):
        ReshardPlan.build(shapes, 6, 2, layout=ParallelDims(pp=2, tp=3))  # 2 neither divides tp*dp = 3 nor is a multiple
    assert ReshardPlan.build(shapes, 4, 4, layout=ParallelDims(pp=2, dp=2)).min_bytes(0) == 8 * F32


def test_switch_seconds_by_hand():
    """dp4 on 2 nodes x 2 devices, gen_tp 2: the micro-DP groups {0,1}, {2,3} stay inside a node.
    One [8, 4] weight: each rank receives 8 floats from one peer -> 32 B / intra bw + 1 latency,
    then copies its 16-float generation slice. Naive: 24 floats from 3 holders, across nodes."""
    c = Cluster(nodes=2, gpus_per_node=2, intra_node_bw=100.0, inter_node_bw=10.0, latency_s=0.5, copy_bw=64.0)
    plan = ReshardPlan.build({"model.layers.0.mlp.up_proj.weight": ((8, 4), F32, 0, 0)}, 4, 2, procs_per_node=2)
    cost = predict_switch(plan, c)
    assert cost["optimized"].bytes_per_rank == [32] * 4 and cost["optimized"].cross_node_bytes == 0
    assert cost["optimized"].predicted_seconds == pytest.approx(32 / 100 + 0.5 + 64 / 64)
    assert cost["naive"].bytes_per_rank == [96] * 4 and cost["naive"].cross_node_bytes == 4 * 64
    assert cost["naive"].predicted_seconds == pytest.approx(96 / 10 + 3 * 0.5 + 64 / 64)


def test_memory_plan_shards_and_kv_cache():
    """Llama-3-8B on 8 ranks (FSDP, fp32 master weights, Adam), generation TP 4, bf16 generation;
    every expected number worked out by hand from the model card's shapes (not from cost.py)."""
    arch = load_arch("llama3-8b")
    # hidden 4096, 32 layers, 32 heads / 8 KV heads of 128, MLP 14336, vocab 128256, untied
    layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096  # q, o; k, v; gate, up, down; 2 norms
    embed = 128256 * 4096
    n = 32 * layer + 2 * embed + 4096
    assert n == 8_030_261_248  # Meta's published count (8.03B)
    norms = 65 * 4096  # replicated in generation (2 per layer + the final one)
    gen_weights = (n - norms) // 4 * 2 + norms * 2  # bf16 quarter of everything TP shards, whole norms
    # KV cache: 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token, a quarter per
    # gen_tp-4 rank; 2 generation replicas share the sequences.
    kv_per_token = 128 * 1024 // 4
    # training, per token and decoder layer in bf16 (what an HF layer saves for backward; tp 1, SDPA with a
    # padding mask): 2 RMSNorms x (fp32 input 4h + fp32 rsqrt 4 + normalised and weighted output 2h + 2h),
    # q/k/v (k, v repeated to the 32 heads) and the output 4 x 4096 x 2, fp32 log-sum-exp 32 x 4, the bf16
    # mask row 1024 x 2, MLP gate / act / up / product 4 x 14336 x 2; then the final norm (8h + 4) once,
    # and the fp32 logits and their log-softmax on the one stage; FULL_SHARD holds two layers unsharded in
    # bf16 (the current and the prefetched one)
    per_layer = 2 * (4096 * 8 + 4) + 4 * 4096 * 2 + 32 * 4 + 1024 * 2 + 4 * 14336 * 2
    assert per_layer == 215_176  # 52.5 h bytes per token (Korthikanti et al.'s 34 h for a 16-bit GPT layer)
    backbone = 1024 * (32 * per_layer + 4096 * 8 + 4)
    acts = backbone + 2 * 1024 * 128256 * 4
    unshard = 2 * layer * 2
    train_peak = n // 2 + n // 2 + n + acts + unshard  # fp32 params + grads (1/8 each), Adam's two moments

    (opt, naive) = rows(arch, ParallelDims(dp=8), 4, Cluster(), MemoryInputs(rollout_seqs=256, seq_len=1024, logits_chunk=None))
    mem = opt["memory"]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (n * 4 // 8, n * 4 // 8, n * 8 // 8)
    assert mem["gen_weights"] == gen_weights
    assert mem["kv_cache"] == kv_per_token * (256 // 2) * 1024 == 4 * GIB
    assert mem["activations"] == acts and mem["fsdp_unshard"] == unshard
    gen_peak = n // 2 + n + gen_weights + 4 * GIB
    assert train_peak > gen_peak + embed * 2  # training is the peak, whichever switch
    assert opt["memory_per_rank_bytes"] == naive["memory_per_rank_bytes"] == train_peak

    # 4x the sequences: 16 GiB of KV cache makes generation the peak, and the naive switch adds the
    # largest group of full tensors it gathers at once: the bf16 embedding table (> a decoder layer's)
    # the chunked log-prob pass (model.use_fused_kernels): the chunk's logits, exp and product in fp32
    # (3 x 1024 x V x 4; the micro-batch's 1,024 tokens are one chunk) and, the head being bf16, the
    # fp32 accumulator of its weight gradient (V x h x 4)
    (chunked, _) = rows(arch, ParallelDims(dp=8), 4, Cluster(), MemoryInputs(rollout_seqs=256, seq_len=1024, logits_chunk=1024))
    assert chunked["memory"]["activations"] == backbone + 3 * 1024 * 128256 * 4 + 128256 * 4096 * 4
    (chunked, _) = rows(arch, ParallelDims(dp=8), 4, Cluster(), MemoryInputs(rollout_seqs=256, seq_len=1024, micro_batch=8, logits_chunk=1024))
    assert chunked["memory"]["activations"] == 8 * backbone + 3 * 1024 * 128256 * 4 + 128256 * 4096 * 4  # 8 x the tokens, 1 chunk

    (opt, naive) = rows(arch, ParallelDims(dp=8), 4, Cluster(), MemoryInputs(rollout_seqs=1024, seq_len=1024, logits_chunk=None))
    gen_peak = n // 2 + n + gen_weights + 16 * GIB
    assert embed > layer and gen_peak > train_peak
    assert opt["memory_per_rank_bytes"] == gen_peak
    assert naive["memory_per_rank_bytes"] == gen_peak + embed * 2


# Decoder-layer shapes for the saved-tensor oracle: the tiny model's Qwen2 (q/k/v biases), SmolLM2-135M's Llama layer
# (9 / 3 heads of 64, MLP 1536) and a Qwen3 layer (per-head q/k norms, head_dim 96 != hidden / heads).
LAYER_SHAPES = {
    "qwen2-tiny": dict(model_type="qwen2", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256),
    "smollm2": dict(model_type="llama", hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536),
    "qwen3": dict(model_type="qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=96, intermediate_size=384),
}


def _saved_by_one_layer(shape: dict, dtype: torch.dtype, attention: str, b: int, s: int, monkeypatch) -> int:
    """Bytes autograd keeps for backward from decoder layer 0 of a real HF model (two layers, random
    weights) in a training forward of b left-padded sequences of s tokens: every tensor a
    saved_tensors_hook sees during that layer's forward, counted once per storage, less the
    parameters and what the model shares across layers (the layer's RoPE cos / sin and mask kwargs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(shape)
    hf = AutoConfig.for_model(cfg.pop("model_type"), **cfg, num_hidden_layers=2, vocab_size=256, max_position_embeddings=4 * s)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf).to(dtype).train()
    kwargs = {}
    if attention == "ulysses":  # the Ulysses kernel on one rank: its all-to-alls are copies (what a group of one does)
        from hybridflow.parallel import ulysses

        monkeypatch.setattr(ulysses, "all_to_all", lambda x, group, scatter_dim, gather_dim: x.clone())
        ulysses.install(model)
        kwargs["ulysses"] = ulysses.SeqShard(None, torch.tensor([0, s]))
        assert b == 1  # one packed row
    else:
        model.set_attn_implementation(attention)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    layer = model.model.layers[0]
    forward = layer.forward

    def hooked(*args, **kw):
        shared = [*kw.get("position_embeddings", ()), kw.get("attention_mask")]
        skip.update(t.untyped_storage().data_ptr() for t in shared if isinstance(t, torch.Tensor))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return forward(*args, **kw)

    layer.forward = hooked
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1:, : s // 4] = 0  # left padding: transformers builds (and SDPA gets) a padding mask
    ids = torch.randint(3, 256, (b, s), generator=torch.Generator().manual_seed(0))
    if attention == "ulysses":
        from hybridflow.parallel import ulysses

        with ulysses.sharded_forward():
            model(input_ids=ids, position_ids=torch.arange(s)[None], **kwargs)
    else:
        model(input_ids=ids, attention_mask=mask)
    return sum(seen.values())


@pytest.mark.parametrize("name,dtype,attention,b", [
    ("qwen2-tiny", torch.float32, "sdpa", 2), ("qwen2-tiny", torch.bfloat16, "eager", 2), ("qwen2-tiny", torch.float32, "ulysses", 1),
    ("smollm2", torch.float32, "sdpa", 2), ("smollm2", torch.bfloat16, "sdpa", 2), ("smollm2", torch.bfloat16, "eager", 2),
    ("smollm2", torch.bfloat16, "ulysses", 1), ("qwen3", torch.bfloat16, "sdpa", 2), ("qwen3", torch.float32, "eager", 2),
])
def test_layer_activation_bytes_equal_what_autograd_saves(name, dtype, attention, b, monkeypatch):
    """The planner's per-layer activation term (`cost.layer_activation_bytes`, from the config alone)
    against the oracle: the bytes autograd saves for backward in a real HF decoder layer, counted by
    saved_tensors_hooks (`_saved_by_one_layer`). Equal to the byte on torch 2.13 / transformers 5.25;
    the 1% tolerance leaves room for small bookkeeping tensors another version may save (e.g. CUDA's
    dropout seeds), not for a missing [tokens, hidden] tensor (>= 4% of a layer's bytes in every case here)."""
    from hybridflow.planning.cost import layer_activation_bytes

    s = 64
    cfg = dict(LAYER_SHAPES[name], num_hidden_layers=2, vocab_size=256)
    arch = Arch.from_config(cfg, name)
    measured = _saved_by_one_layer(LAYER_SHAPES[name], dtype, attention, b, s, monkeypatch)
    predicted = layer_activation_bytes(arch, b, s, dtype.itemsize, attention=attention)
    assert predicted == pytest.approx(measured, rel=0.01), (measured / (b * s), predicted / (b * s))
    # the old constant, Korthikanti et al.'s 34 h bytes per token in 16-bit, under-counts these layers
    assert measured > 34 * arch.hidden * b * s * dtype.itemsize / 2


def test_logprob_pass_memory_by_hand():
    """One no-grad log-prob micro-batch of SmolLM2-135M (h 576, i 1536, V 49,152), fp32, 16 x (16 +
    1,024) tokens, with entropy: the plain pass holds 3 fp32 [16 x 1,025, V] buffers (logits, softmax,
    their product), the chunked one 3 [1,024, V]; both plus the final and the kept hidden states.
    bench/logprob_memory.py measures both against these."""
    from hybridflow.planning.cost import logprob_pass_bytes

    arch = load_arch("smollm2-135m")
    hidden = (16 * 1040 + 16 * 1024) * 576 * 4
    plain = logprob_pass_bytes(arch, MemoryInputs(compute_bytes=4, micro_batch=16, seq_len=1040, response_len=1024, logits_chunk=None))
    chunked = logprob_pass_bytes(arch, MemoryInputs(compute_bytes=4, micro_batch=16, seq_len=1040, response_len=1024, logits_chunk=1024))
    assert plain == hidden + 3 * 16 * 1025 * 49152 * 4
    assert chunked == hidden + 3 * 1024 * 49152 * 4
    # a short chunk: a decoder layer's MLP (3 h + 3 i per token) is the larger transient
    small = logprob_pass_bytes(arch, MemoryInputs(compute_bytes=4, micro_batch=16, seq_len=1040, response_len=1024, logits_chunk=64))
    assert small == (3 * 576 + 3 * 1536) * 16 * 1040 * 4


def test_preflight_counts_the_engines_attention_kernel(tiny_model_dir):
    """The pre-flight memory check plans the kernel the engine runs: eager (with its [heads, s, s]
    probabilities) for bf16 compute on CPU (engine/cpu_kernels.py), SDPA on CUDA, in fp32 and in the
    exact rollout mode."""
    from hybridflow.config.loader import load_config
    from hybridflow.config.schema import MICRO_BATCH_CAP
    from hybridflow.planning.cost import layer_activation_bytes
    from hybridflow.planning.preflight import pool_memory

    base = [f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_files=[x]", "actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16"]

    def acts(*extra: str) -> int:
        return next(iter(pool_memory(load_config(None, [*base, *extra])).values()))["parts"]["actor_rollout"]["activations"]

    cpu, cuda, exact = acts("trainer.device=cpu"), acts("trainer.device=cuda"), acts("trainer.device=cpu", "actor_rollout_ref.rollout.exact=true")
    cfg = load_config(None, base)
    arch, seq = load_arch(str(tiny_model_dir)), cfg.data.max_prompt_length + cfg.data.max_response_length
    b = cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu or MICRO_BATCH_CAP  # the pre-flight's micro-batch when unset
    per_layer = {k: layer_activation_bytes(arch, b, seq, 2, attention=k) for k in ("eager", "sdpa")}
    assert cpu - cuda == arch.layers * (per_layer["eager"] - per_layer["sdpa"]) > 0
    assert exact == cuda


def test_search_ranks_and_says_why(tmp_path):
    arch = load_arch("qwen2.5-7b")  # 28 heads, 4 KV heads, 28 layers
    ranked, invalid = search(arch, Cluster(nodes=1, gpus_per_node=8), MemoryInputs())
    reasons = {(i.train_layout, i.gen_tp): i.reason for i in invalid}
    assert "does not divide the 4 KV heads" in reasons[("dp8", 8)]
    assert "does not divide the 28 decoder layers" in reasons[("pp8xdp1", None)]
    assert "does not divide the 4 KV heads" in reasons[("tp8xdp1", None)]
    secs = [r["predicted_seconds"] for r in ranked]
    assert secs == sorted(secs) and all(r["fits"] for r in ranked)
    _, small = search(arch, Cluster(nodes=1, gpus_per_node=2, memory_bytes=8 * GIB), MemoryInputs(), layouts=[ParallelDims(dp=2)])
    assert any(i.reason.startswith("does not fit: peak") for i in small)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_delta_bytes_prediction_equals_what_the_delta_sync_encodes(tiny_model_dir, dtype):
    """`hybridflow plan`'s delta bytes against the delta sync's own encoder (`delta.encode`), the
    oracle: every rank's generation slices (dp2 -> gen tp2 and tp1) with exactly ceil(f x n)
    elements of each piece changed, encoded against the old piece; the payloads' bytes summed equal
    the prediction at every fraction, both sides of the sparse/whole crossover (1/3 in bf16, 1/2 in
    fp32)."""
    from hybridflow.hybrid_engine.delta import encode, payload_bytes
    from hybridflow.planning.cost import delta_sync_bytes

    g = torch.Generator().manual_seed(0)
    for gen_tp in (1, 2):
        plan = plan_for(load_arch(str(tiny_model_dir)), ParallelDims(dp=2), gen_tp, dtype.itemsize)
        for f in (0.0, 0.01, 0.3, 0.4, 0.6, 1.0):
            for r in range(2):
                sent = 0
                for p in plan.params:
                    old = torch.randn([hi - lo for lo, hi in p.need[r]], generator=g).to(dtype)
                    new = old.clone()
                    k = math.ceil(f * new.numel())
                    flat = new.view(-1)
                    idx = torch.randperm(new.numel(), generator=g)[:k]
                    flat[idx] = (flat[idx].float() + 1.0).to(dtype)  # a different value (x + 1 != x at these magnitudes)
                    sent += payload_bytes(encode(new, old, False)[0])
                assert sent == delta_sync_bytes(plan, f, r), (gen_tp, f, r)
    assert delta_sync_bytes(plan, 1.0, 0) == plan.gen_buffer_bytes(0)  # all changed: the whole slices


def test_plan_cli_json(tmp_path, capsys):
    from hybridflow.planning.cli import main_plan

    out = tmp_path / "plan.json"
    main_plan("--preset llama3-8b --nodes 8 --gpus-per-node 8 --train-layout pp2xtp8xdp4 --gen-tp 4,8 --json".split() + [str(out)])
    data = json.loads(out.read_text())["rows"]
    assert [(r["gen_tp"], r["mode"]) for r in data] == [(4, "optimized"), (4, "naive"), (8, "optimized"), (8, "naive")]
    for r in data:
        assert {"mode", "bytes_per_rank", "cross_node_bytes", "predicted_seconds", "memory_per_rank_bytes"} <= set(r)
    opt4, naive4 = data[:2]
    assert opt4["bytes_per_rank"] < naive4["bytes_per_rank"] and opt4["predicted_seconds"] < naive4["predicted_seconds"]
    printed = capsys.readouterr().out
    assert "memory plan per rank" in printed
    # the cross-pool sync per generation layout: whole, and as a delta at the measured bf16 default
    assert opt4["delta_changed_fraction"] == 0.02 and 0 < opt4["delta_bytes_per_rank"] < 0.1 * opt4["full_sync_bytes_per_rank"]
    assert "cross-pool sync to gen tp4 (async rollout)" in printed and "at 0.02 of the elements changed" in printed
    main_plan("--preset llama3-8b --nodes 8 --gpus-per-node 8 --train-layout pp2xtp8xdp4 --gen-tp 4 --delta-changed-fraction 1 --json".split() + [str(out)])
    whole = json.loads(out.read_text())["rows"][0]
    assert whole["delta_bytes_per_rank"] == whole["full_sync_bytes_per_rank"]  # all changed: pieces sent whole
    with pytest.raises(SystemExit, match="--delta-changed-fraction must be a fraction"):
        main_plan("--preset llama3-8b --gen-tp 4 --delta-changed-fraction 2".split())
    with pytest.raises(SystemExit, match="does not divide the 8 KV heads"):
        main_plan("--preset llama3-8b --nodes 8 --gpus-per-node 8 --train-layout pp2xtp8xdp4 --gen-tp 16".split())
    with pytest.raises(SystemExit, match="has 8 ranks but the cluster has 64"):
        main_plan("--preset llama3-8b --nodes 8 --gpus-per-node 8 --train-layout tp8".split())


def test_calibration_feeds_the_cli(tmp_path, capsys):
    from hybridflow.planning.cli import main_plan

    path = tmp_path / "cal.json"
    main_plan(["--calibrate", "--procs", "2", "--out", str(path)])
    cal = json.loads(path.read_text())
    assert cal["bandwidth"] > 0 and cal["copy_bw"] > 0 and len(cal["points"]) == 3
    main_plan(["--preset", "smollm2-135m", "--gpus-per-node", "2", "--gen-tp", "1", "--calibration", str(path), "--json", str(tmp_path / "p.json")])
    row = json.loads((tmp_path / "p.json").read_text())["rows"][0]
    assert row["cluster"]["intra_node_bw"] == cal["intra_node_bw"]
