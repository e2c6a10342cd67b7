"""Tensor-parallel GENERATION layout for HF causal LMs (Qwen2 / Llama), and the shard-dim table.

Which rank has which generation coordinates is the layout object's (`parallel/dims.py`,
`ParallelDims.gen_rank`). With N actor ranks in the FSDP layout and ``gen_tp`` dividing N, k = N // gen_tp:
    rank r -> generation TP index r // k, generation DP index r % k;
    TP groups are the strided rank sets {j, j+k, j+2k, ...} (j < k).
The (tp, dp) DeviceMesh ``arange(N).reshape(gen_tp, k)`` has exactly these groups as ``mesh["tp"]``.
Training (FSDP2) shards each parameter over all N ranks along the SAME dim that generation TP
shards it (``fsdp_shard_placement_fn``), so TP rank t needs FSDP slices t*k .. t*k+k-1: the k
consecutive ranks of its micro-DP group (see design.md, "The resharding, precisely").

One explicit table (nano-vllm style) decides every parameter's generation shard dim; the TP plan,
the FSDP2 placement and the resharding planner all read it through :func:`gen_shard_dim`.

Simplifications: no sequence parallel, no fused qkv / gate_up (HF keeps them separate; a vLLM
backend concatenates per TP rank on top of this table), tied embeddings stay replicated.
torch is imported inside the functions that need it: the table is pure Python. The generation TP
rules (:func:`validate_gen_tp`, re-exported here) live with the layout in `parallel/dims.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from hybridflow.parallel.dims import TP_KEY, ParallelDims, validate_gen_tp  # noqa: F401  (TP_KEY, validate_gen_tp re-exported)

if TYPE_CHECKING:
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # weight [out, in]: dim 0; bias dim 0
ROWWISE = ("o_proj", "down_proj")  # weight [out, in]: dim 1; bias replicated (added after the all-reduce)
EMBED, LM_HEAD = "embed_tokens", "lm_head"  # vocab-parallel: weight dim 0, unless tied (then replicated)


def gen_shard_dim(param_name: str, tied: bool) -> int | None:
    """Dim along which generation TP shards the parameter ``param_name`` (an FQN), None = replicated.

    Only the last two FQN components matter, so wrapper prefixes (``_orig_mod.``, ``module.``) are fine:
    "model.layers.0.self_attn.q_proj.weight" -> 0, "model.layers.0.mlp.down_proj.weight" -> 1,
    "model.norm.weight" -> None, "lm_head.weight" -> 0 (None when ``tied``). LoRA names follow their
    module: "...q_proj.base_layer.weight" -> 0, "...q_proj.lora_B.default.weight" -> 0, "...q_proj.lora_A..." -> None,
    "...o_proj.lora_A.default.weight" -> 1, "...o_proj.lora_B..." -> None.
    """
    parts = param_name.split(".")
    if len(parts) < 2:
        return None
    module, leaf = parts[-2], parts[-1]
    if module == "base_layer" and len(parts) >= 3:  # a LoRA layer's frozen base (models/lora.py): the module's own rule
        module = parts[-3]
    elif len(parts) >= 4 and parts[-3] in ("lora_A", "lora_B"):
        # LoRA adapters X(x) = W x + B A x: a colwise X shards B [out, r] by rows (A replicated), a
        # rowwise X shards A [r, in] by columns (B replicated), so each TP rank computes its own part.
        lora, module = parts[-3], parts[-4]
        if leaf != "weight":
            return None
        if module in COLWISE:
            return 0 if lora == "lora_B" else None
        return 1 if module in ROWWISE and lora == "lora_A" else None
    if module in COLWISE and leaf in ("weight", "bias"):
        return 0
    if module in ROWWISE and leaf == "weight":
        return 1
    if module in (EMBED, LM_HEAD) and leaf == "weight" and not tied:
        return 0
    return None


def is_tied(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "tie_word_embeddings", False))


def gen_shard_dims(model: nn.Module) -> dict[str, int | None]:
    """{parameter FQN: generation shard dim} for every (deduplicated) parameter of ``model``."""
    tied = is_tied(model)
    return {name: gen_shard_dim(name, tied) for name, _ in model.named_parameters()}


def _gen_dims(world_size: int, gen_tp: int, layout: ParallelDims | None) -> ParallelDims:
    """`layout` (None: FSDP over all ranks) with the generation TP size `gen_tp` (checked)."""
    dims = (layout or ParallelDims(dp=world_size)).with_gen(gen_tp)
    if dims.world != world_size:
        raise ValueError(f"training layout {dims.label} has {dims.world} ranks, not {world_size}")
    return dims


def gen_ranks(rank: int, world_size: int, gen_tp: int, layout: ParallelDims | None = None) -> tuple[int, int]:
    """(generation TP index, generation DP index) of ``rank``: `ParallelDims.gen_rank` of `layout`
    (None = FSDP over all ranks; HybridFlow's grouping for a 3D training layout)."""
    return _gen_dims(world_size, gen_tp, layout).gen_rank(rank)


def gen_mesh(device: str, world_size: int, gen_tp: int, layout: ParallelDims | None = None) -> DeviceMesh:
    """The 2-D (tp, dp) mesh whose entry [t, d] is the rank with generation coordinates (t, d):
    ``arange(N).reshape(gen_tp, k)`` for the FSDP layout, so ``mesh["tp"]`` = strided TP groups.

    Collective over the default process group (every rank must call it; slicing creates sub-groups).
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    dims = _gen_dims(world_size, gen_tp, layout)
    grid = torch.empty(gen_tp, dims.gen_dp, dtype=torch.int)
    for r in range(world_size):
        grid[dims.gen_rank(r)] = r
    return DeviceMesh(device, grid, mesh_dim_names=("tp", "dp"))


def _check_heads(model: nn.Module, tp: int) -> None:
    cfg = model.config.get_text_config()  # a VLM: its language model's heads (the tower is not split)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    problems = validate_gen_tp(tp, tp, heads, kv)
    if problems:
        raise ValueError(f"{type(model).__name__}: " + "; ".join(problems))


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` in place for generation over the 1-D ``tp_mesh`` (no-op when its size is 1).

    Per decoder layer: q/k/v/gate/up ColwiseParallel (output = local heads / local FFN columns),
    o/down RowwiseParallel (partial sums all-reduced to a whole hidden state). Untied embedding:
    vocab-parallel (RowwiseParallel(input_layouts=Replicate()): masked lookup + all-reduce); untied
    lm_head: ColwiseParallel(output_layouts=Replicate()) so logits come out whole (all-gather).

    HF attention needs NO per-rank patch (transformers v5 Qwen2/Llama): q/k/v are reshaped with
    ``(*input_shape, -1, head_dim)`` so the head count follows the local width (heads/tp, kv/tp);
    the output is reshaped with ``(*input_shape, -1)``; ``num_key_value_groups`` = heads // kv_heads
    is a ratio that tp divides out of both, and ``head_dim`` / ``scaling`` do not change. Layer
    outputs are plain (replicated) tensors, so norms, rotary embeddings, the KV cache and
    ``generate`` see ordinary torch tensors; only the sharded Linear/Embedding weights are DTensors.
    """
    import torch.nn as nn
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from hybridflow.parallel.fsdp import decoder_layers

    tp = tp_mesh.size()
    if tp == 1:
        return model
    _check_heads(model, tp)
    for layer in decoder_layers(model):
        plan = {}
        for name, mod in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            lora = getattr(mod, "lora_A", None)  # a peft LoRA layer (models/lora.py): X(x) = base(x) + B(A(x)) * s
            if lora is not None and leaf in COLWISE + ROWWISE:
                # base sharded as X would be; colwise: B by rows (A x is whole, B A x comes out sharded
                # like base(x)); rowwise: A by columns (its input is the sharded x; A x is all-reduced)
                plan[f"{name}.base_layer"] = ColwiseParallel() if leaf in COLWISE else RowwiseParallel()
                for adapter in lora:
                    if leaf in COLWISE:
                        plan[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
                    else:
                        plan[f"{name}.lora_A.{adapter}"] = RowwiseParallel()
            elif isinstance(mod, nn.Linear) and leaf in COLWISE:
                plan[name] = ColwiseParallel()
            elif isinstance(mod, nn.Linear) and leaf in ROWWISE:
                plan[name] = RowwiseParallel()
        # src_data_rank=None: every rank already holds the full weights; each keeps its own slice
        # (no broadcast from TP rank 0).
        parallelize_module(layer, tp_mesh, plan, src_data_rank=None)
    if not is_tied(model):  # by name: a pipeline stage (`pipeline.StageLM`) may hold either or neither
        plan = {}
        for name, mod in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == EMBED and isinstance(mod, nn.Embedding):
                plan[name] = RowwiseParallel(input_layouts=Replicate())
            elif leaf == LM_HEAD and isinstance(mod, nn.Linear):
                plan[name] = ColwiseParallel(output_layouts=Replicate())
        if plan:
            parallelize_module(model, tp_mesh, plan, src_data_rank=None)
    return model


def fsdp_shard_placement_fn(model: nn.Module, world_size: int | None = None) -> Callable[[nn.Parameter], Shard | None]:
    """For ``fully_shard(..., shard_placement_fn=...)``: shard each parameter for TRAINING along its
    generation TP dim (``gen_shard_dim``); replicated-in-generation parameters get Shard(0).

    FSDP2 cannot shard unevenly along a dim other than 0: a row-parallel weight whose dim 1 does not
    divide by ``world_size`` falls back to Shard(0) (the resharding planner then moves boxes
    between the two layouts). FSDP2 calls the fn with the Parameter object, so the dims are keyed
    by ``id(param)``: build this BEFORE ``fully_shard`` replaces the parameters (and after a
    training TP plan, which does too); ``world_size`` = the FSDP (dp) size.
    """
    from torch.distributed.tensor import Shard

    tied = is_tied(model)
    dims = {id(p): gen_shard_dim(name, tied) for name, p in model.named_parameters()}

    def placement(param: nn.Parameter) -> Shard:
        dim = dims.get(id(param)) or 0
        local = param.to_local() if hasattr(param, "to_local") else param  # a training-TP DTensor: its TP slice
        if dim and world_size and local.shape[dim] % world_size:
            dim = 0
        return Shard(dim)

    return placement
