"""The planner's cost model: what a layout's weight switch moves and costs, and what each rank holds.

Stated model (docs/planning.md explains it and its limits):

- Bytes are exact: the resharding planner's boxes (`hybrid_engine/plan.py`) for the training layout
  pp x tp x dp and the generation layout gen_tp x gen_dp; a parameter's FSDP shard dim is the one
  `fsdp_shard_placement_fn` picks, so on layouts the engine runs the bytes equal what it measures.
- Seconds: the optimized switch runs, per switch unit (a layer, or consecutive small layers
  merged: `staging.switch_units`), one coalesced collective per process group (the micro-DP groups
  for TP-sharded parameters, all holders for replicated ones); a collective costs max over ranks of
  (bytes the rank receives in it / the bandwidth of the slowest link those bytes cross) + latency x
  (number of ranks it receives from); then every rank copies its generation slice once (bytes /
  copy_bw), but for the slices it borrows (its own training shard, when `borrow`: the switch's dtype
  is the training shards'). The naive switch gathers every full parameter over its holders
  (one collective per parameter, same per-link formula), then slices.
- Memory per rank (bytes): training shards, gradients, AdamW state, activations of the micro-batch
  (what an HF decoder layer saves for backward, from the config: `layer_activation_bytes`, measured
  tensor by tensor with saved-tensor hooks; x pp micro-batches in flight for 1F1B; the final norm and
  the fp32 logits term on the last stage:
  [tokens, V] for the plain logits pass, [chunk, V] for the chunked one, `logits_bytes`; under
  Ulysses (layout.sp) a rank holds the activations of its seq_len / sp tokens, and every one of them
  goes through the head),
  FSDP's unsharded layer buffers, generation weights and the KV cache of the rollout batch. Peak =
  max(training phase, generation phase). Not included: CUDA context, allocator fragmentation,
  temporary buffers of kernels — keep headroom.
- Staging of the layer-wise switch (reported next to the peak, not in it): W layers in flight, each
  in a slot of the largest layer's staging need, W from `resharding_buffer_percent`
  (`MemoryInputs.buffer_percent`; unset: 2) by the engine's own rule (`hybrid_engine/staging.py`).
- MoE (`expert_comm`): expert weights are sharded by expert over ep (the plan's boxes), FSDP2 gathers
  a layer's experts over dp / ep only (`fsdp_unshard`); per training step the experts' FSDP2 traffic
  and the tokens' all-to-all are predicted (uniform routing) and added to the ranking (`search.py`).
  Activations: a sparse layer's MLP term counts the token's top_k experts (`mlp_width`), not the k
  routed copies of its hidden state.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hybridflow.hybrid_engine.plan import ParamPlan, ReshardPlan, layer_stage, volume
from hybridflow.parallel.dims import ParallelDims
from hybridflow.hybrid_engine.plan import fsdp_dim as _fsdp_dim
from hybridflow.hybrid_engine.staging import staging_plan, switch_units
from hybridflow.models.lora import is_adapter_param
from hybridflow.parallel.expert_parallel import is_expert_param
from hybridflow.parallel.tensor_parallel import gen_shard_dim
from hybridflow.planning.arch import Arch

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
GIB = 1024**3


def human(nbytes: float) -> str:
    """1536 -> "1.5 KiB", 3 * 2**30 -> "3.00 GiB"."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


@dataclass
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    intra_node_bw: float = 200e9  # bytes/s each GPU receives over NVLink (A100 NCCL all-gather bus bandwidth)
    inter_node_bw: float = 25e9  # bytes/s each GPU receives across nodes (one 200 Gb/s InfiniBand NIC per GPU)
    latency_s: float = 20e-6  # per collective step
    copy_bw: float = 1.5e12  # bytes/s of a device-local copy (A100 HBM2e)
    memory_bytes: float = 80 * GIB  # per device

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class MemoryInputs:
    """What the memory plan needs besides the layouts (defaults: bf16 mixed precision on fp32 shards)."""

    param_bytes: int = 4  # training shards (FSDP keeps fp32 master weights under mixed precision)
    compute_bytes: int = 2  # activations and FSDP's unsharded compute copies (bf16)
    gen_bytes: int = 2  # generation weights and KV cache
    optim_bytes_per_param: int = 8  # AdamW exp_avg + exp_avg_sq in fp32
    strategy: str = "FULL_SHARD"
    micro_batch: int = 1  # sequences per training micro-batch per rank
    seq_len: int = 2048  # prompt + response tokens
    rollout_seqs: int = 1024  # sequences generated per step (prompts x n), over every generation replica
    gradient_checkpointing: bool = False
    param_offload: bool = False
    optimizer_offload: bool = False
    lora_rank: int = 0  # > 0: LoRA adapters on every projection train; the base is frozen (no grads / optimizer state)
    buffer_percent: float | None = None  # actor_rollout_ref.hybrid_engine.resharding_buffer_percent (None: 2 layers in flight)
    response_len: int | None = None  # tokens per sequence whose log-probs are computed (None: seq_len)
    logits_chunk: int | None = 1024  # model.fused_kernel_chunk_size under model.use_fused_kernels; None: the plain logits pass
    attention: str = "sdpa"  # sdpa | eager | ulysses: the attention kernel (`layer_activation_bytes`; layout.sp > 1 runs ulysses)
    packed: bool = False  # model.use_remove_padding: a micro-batch's sequences in one row (the mask / eager's scores span b x s tokens)


def logits_bytes(tokens: int, vocab: int, chunk: int | None, buffers: int) -> int:
    """Peak bytes of a log-prob pass's fp32 vocabulary-sized buffers: `buffers` of [tokens, V] (the
    plain pass) or of [min(chunk, tokens), V] (the chunked pass, `engine/fused_logprobs.py`)."""
    return buffers * (tokens if chunk is None else min(chunk, tokens)) * vocab * 4


def train_logits_bytes(arch: Arch, m: MemoryInputs, sp: int = 1) -> int:
    """The update's logits term on the last stage. Plain: the fp32 logits and their log-softmax over
    the micro-batch's tokens (2 x tokens x V x 4). Chunked: the chunk's logits, exp and product in
    forward (3 x chunk x V x 4) and, for a head in less than fp32, the fp32 accumulator of its
    weight gradient (V x H x 4). Ulysses (sp > 1): every one of the rank's seq_len / sp positions
    goes through the head (`parallel/ulysses.py`)."""
    tokens = m.micro_batch * (m.response_len or m.seq_len) if sp == 1 else m.micro_batch * math.ceil(m.seq_len / sp)
    if m.logits_chunk is None:
        return logits_bytes(tokens, arch.vocab, None, 2)
    return logits_bytes(tokens, arch.vocab, m.logits_chunk, 3) + (arch.vocab * arch.hidden * 4 if m.compute_bytes < 4 else 0)


ATTENTION_KINDS = ("sdpa", "eager", "ulysses")


def norm_bytes(width: int, c: int, rows: int = 1) -> int:
    """Bytes an HF RMSNorm saves per token (Llama/Qwen: the input upcast to fp32, x * rsqrt(mean(x^2)),
    cast back, times the weight): its fp32 input [width] (a copy when c < 4), the fp32 rsqrt [rows] and
    the normalised value [width] in the compute dtype (c bytes); rows > 1 for Qwen3's per-head q/k norms."""
    return width * (4 + c) + 4 * rows


def mlp_width(arch: Arch, layer: int) -> int:
    """The MLP width a token goes through in `layer`: the dense intermediate size, or an MoE layer's
    top_k experts (+ the shared expert): the routed copies of the token themselves are not counted."""
    return arch.top_k * arch.expert_intermediate + arch.shared_intermediate if arch.sparse(layer) else arch.intermediate


def layer_activation_bytes(arch: Arch, b: int, s: int, c: int, tp: int = 1, attention: str = "sdpa", packed: bool = False,
                           layer: int = 0) -> int:
    """Bytes one HF decoder layer (Llama / Mistral / Qwen2 / Qwen3; transformers 5) keeps for backward,
    for a micro-batch of b sequences of s tokens in compute dtype c bytes, TP degree tp (q, kv and the
    MLP split, the norms replicated). Per token, q = heads x head_dim, kv = kv_heads x head_dim:

    - 2 RMSNorms (input, post-attention): each `norm_bytes(h)` = h (4 + c) + 4, plus the weighted output
      [h] (c bytes), which is the next projections' input: 2 (h (4 + 2c) + 4);
    - Qwen3's q/k norms: `norm_bytes(q, heads)` + `norm_bytes(kv, kv_heads)`;
    - attention, by kernel (`attention`):
      sdpa: q, k, v after RoPE and the output [q] each, 4 q c (transformers repeats k/v to every head
        under a padding mask), the fp32 log-sum-exp [heads] (the output is the o_proj input: same
        storage), and the padding mask as SDPA converts it from bool to the compute dtype, in every
        layer: [span] per token (span: s, or b x s when the micro-batch is packed into one row). A
        batch without padding runs causal SDPA with no mask and k/v at kv width: (2 q - 2 kv) c + span c less;
      ulysses (`parallel/ulysses.py`): the same on [heads / sp, T] after the all-to-all, plus the output
        again after the trade back (the o_proj input): 5 q c + 4 heads;
      eager (`engine/cpu_kernels.py`: bf16 on CPU): q, K^T, V (repeated) and the output, 4 q c, plus
        the softmax probabilities [heads, span] in fp32 and, when c < 4, their compute-dtype copy;
    - MLP of width i (`mlp_width`): gate, act(gate), up and act(gate) x up [i] each, 4 i c.

    Not per layer (not here): RoPE's cos / sin [s, head_dim] and the bool mask transformers builds,
    once per forward and shared by every layer. tests/test_planning.py checks this against the bytes
    autograd saves on real HF layers (saved_tensors_hooks), fp32 and bf16, sdpa, eager and ulysses."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention {attention!r}: one of {', '.join(ATTENTION_KINDS)}")
    h, q, kv, heads = arch.hidden, arch.heads * arch.head_dim // tp, arch.kv_heads * arch.head_dim // tp, arch.heads // tp
    per_token = 2 * (norm_bytes(h, c) + h * c) + 4 * mlp_width(arch, layer) // tp * c
    if arch.qk_norm:
        per_token += norm_bytes(q, c, heads) + norm_bytes(kv, c, arch.kv_heads // tp)
    span = b * s if packed else s  # the keys a query's row of scores (or of the mask) spans
    if attention == "eager":
        per_token += 4 * q * c + heads * span * (4 + (c if c < 4 else 0))
    elif attention == "sdpa":
        per_token += 4 * q * c + 4 * heads + span * c
    else:  # ulysses: causal SDPA inside each packed sequence, no mask
        per_token += 5 * q * c + 4 * heads
    return b * s * per_token


def logprob_pass_bytes(arch: Arch, m: MemoryInputs, entropy: bool = True, sp: int = 1) -> int:
    """Peak bytes of one no-grad log-prob micro-batch (old / ref / teacher log-probs) over the
    resident weights: the larger of
    - a decoder layer's forward at its MLP, (3 h + 3 i) x tokens x compute bytes: the layer's input,
      the residual and the normed input [b, s, h]; act(gate), up and their product [b, s, i]
      (SDPA attention: no [s, s] scores);
    - the head: the final hidden states [b, s, h] and the kept positions [b, R, h], and the fp32
      vocabulary buffers (`logits_bytes`): with entropy the logits, the softmax and their product
      (3; 2 without entropy: the logits and the log-softmax), over b x (R + 1) positions (plain,
      `logits_to_keep`) or one chunk;
    - eager attention (m.attention): the probabilities [b, heads, s, span] in fp32 and their
      compute-dtype copy (`layer_activation_bytes`).
    Ulysses (sp > 1): the rank's seq_len / sp tokens, every one of them through the head."""
    b, s, r = m.micro_batch, math.ceil(m.seq_len / sp), m.response_len or m.seq_len
    if sp > 1:
        r = s - 1  # rows = b x s below: every local position is scored
    layer = (3 * arch.hidden + 3 * arch.intermediate) * b * s * m.compute_bytes
    if m.attention == "eager" and sp == 1:  # the probabilities [b, heads, s, span] in fp32 and their compute-dtype copy
        layer = max(layer, b * s * arch.heads * (b * s if m.packed else s) * (4 + (m.compute_bytes if m.compute_bytes < 4 else 0)))
    rows = b * (r + 1) if m.logits_chunk is None else b * r
    head = (b * s + b * r) * arch.hidden * m.compute_bytes + logits_bytes(rows, arch.vocab, m.logits_chunk, 3 if entropy else 2)
    return max(layer, head)


def frozen_params(plan: ReshardPlan, m: MemoryInputs) -> frozenset[str]:
    """LoRA: every parameter but the adapters is frozen; it moves on the first switch only."""
    return frozenset(p.name for p in plan.params if not is_adapter_param(p.name)) if m.lora_rank > 0 else frozenset()


def fsdp_dim(name: str, shape: tuple[int, ...], arch: Arch, layout: ParallelDims, strategy: str) -> int | None:
    """The dim FSDP2 shards a parameter's TP slice along (`fsdp_shard_placement_fn`), None = NO_SHARD."""
    if strategy == "NO_SHARD" or layout.dp == 1:
        return None
    return _fsdp_dim(shape, gen_shard_dim(name, arch.tied), layout)


def plan_for(arch: Arch, layout: ParallelDims, gen_tp: int, itemsize: int, strategy: str = "FULL_SHARD",
             procs_per_node: int | None = None, lora_rank: int = 0) -> ReshardPlan:
    """The engine's plan for `arch` (no model built): exact per-rank boxes and bytes."""
    shapes = {n: (s, itemsize, fsdp_dim(n, s, arch, layout, strategy), gen_shard_dim(n, arch.tied))
              for n, s in arch.param_shapes(lora_rank).items()}
    experts = frozenset(n for n in shapes if is_expert_param(n))  # sharded by expert over layout.ep (the plan's boxes)
    return ReshardPlan.build(shapes, layout.world, gen_tp, procs_per_node, layout=layout, experts=experts)


def expert_comm(arch: Arch, layout: ParallelDims, cluster: Cluster, m: MemoryInputs) -> dict:
    """Per training step and rank, the MoE communication that ep changes (0 for a dense model), one PPO
    epoch of ceil(rollout_seqs / dp / micro_batch) micro-batches, uniform routing:
    - FSDP2 on the expert weights: this rank's [E/ep] experts per sparse layer are sharded over the
      edp = dp / ep ranks holding the same ones: gathered in forward and again in backward (compute
      bytes) and the gradients reduce-scattered (param bytes): (edp - 1) / edp of them received each;
    - the tokens' all-to-all over the EP group (`parallel/expert_parallel.py`): tokens x k rows of H,
      (ep - 1) / ep of them leave the rank, dispatch and combine in forward and in backward (4x; 6x
      with gradient checkpointing, whose recomputation dispatches again).
    Links: an EP group is ep consecutive ranks (intra-node when it fits a node); an edp group's ranks
    are ep apart, intra-node only when all dp ranks are on one node."""
    sparse = sum(arch.sparse(i) for i in range(arch.layers))
    micro = math.ceil(m.rollout_seqs / layout.dp / m.micro_batch)
    if not sparse:
        return dict(expert_fsdp_bytes_per_step=0, a2a_bytes_per_step=0, expert_comm_seconds=0.0)
    ep, edp, gpn = layout.ep, layout.dp // layout.ep, cluster.gpus_per_node
    local = arch.experts * 3 * arch.expert_intermediate * arch.hidden // ep  # expert parameters per layer on an EP rank
    fsdp = sparse * local * (edp - 1) / edp * (2 * m.compute_bytes + m.param_bytes)
    a2a = sparse * m.micro_batch * m.seq_len * arch.top_k * arch.hidden * m.compute_bytes * (ep - 1) / ep * (6 if m.gradient_checkpointing else 4)
    ep_bw = cluster.intra_node_bw if ep <= gpn and gpn % ep == 0 else cluster.inter_node_bw
    edp_bw = cluster.intra_node_bw if layout.dp <= gpn or edp == 1 else cluster.inter_node_bw
    return dict(expert_fsdp_bytes_per_step=int(micro * fsdp), a2a_bytes_per_step=int(micro * a2a),
                expert_comm_seconds=micro * (fsdp / edp_bw + a2a / ep_bw))


@dataclass
class SwitchCost:
    mode: str  # optimized | naive
    bytes_per_rank: list[int]
    cross_node_bytes: int
    predicted_seconds: float
    collectives: int


def _link_seconds(plan: ReshardPlan, cluster: Cluster, r: int, recv: list[tuple[int, int]]) -> tuple[float, int]:
    """(seconds for rank r to receive `recv` over its slowest link, ranks it receives from)."""
    if not recv:
        return 0.0, 0
    cross = any(plan.node(s) != plan.node(r) for s, _ in recv)
    bw = cluster.inter_node_bw if cross else cluster.intra_node_bw
    return sum(b for _, b in recv) / bw, len({s for s, _ in recv})


def _collective_seconds(plan: ReshardPlan, cluster: Cluster, params: list[ParamPlan], naive: bool) -> float:
    """One collective over `params`: the slowest rank's receive time plus one latency per source."""
    worst, sources = 0.0, 0
    for r in range(plan.world_size):
        recv = [x for p in params for x in plan.routes(p, naive)[r]]
        t, n = _link_seconds(plan, cluster, r, recv)
        worst, sources = max(worst, t), max(sources, n)
    return worst + cluster.latency_s * sources


def predict_switch(plan: ReshardPlan, cluster: Cluster, frozen: frozenset[str] = frozenset(), borrow: bool = True) -> dict[str, SwitchCost]:
    """The optimized and the naive switch; `frozen` parameters (LoRA's base) moved on the first switch
    and cost nothing in the optimized (steady) one, while the naive one moves the whole model.
    borrow: the switch's dtype is the training shards', so a generation slice that is the rank's own
    shard is borrowed, not copied (the engine's `borrowed`)."""
    n = plan.world_size
    lent = [sum(p.gen_bytes(r) for p in plan.params if borrow and p.own[r] == p.need[r]) for r in range(n)]
    copy = max(plan.gen_buffer_bytes(r) - lent[r] for r in range(n)) / cluster.copy_bw
    unit_of = {layer: unit for unit in switch_units(plan) for layer in unit}
    by_layer: dict[tuple, list[ParamPlan]] = {}
    for p in plan.params:
        by_layer.setdefault(unit_of[p.layer], []).append(p)
    memo: dict[tuple, float] = {}  # units of one stage cost the same: compute each composition once

    def seconds(params: list[ParamPlan], naive: bool) -> float:
        key = (naive, *((id(p.own), id(p.need), p.itemsize) for p in params))
        if key not in memo:
            memo[key] = _collective_seconds(plan, cluster, params, naive)
        return memo[key]

    def collectives(params: list[ParamPlan]) -> list[list[ParamPlan]]:
        """A unit's parameters by process group (TP-sharded ones in the micro-DP groups, replicated
        ones over their holders): one coalesced collective each."""
        groups: dict[tuple, list[ParamPlan]] = {}
        for p in params:
            groups.setdefault(tuple(map(tuple, p.group)) if len(p.group[0]) < n else (), []).append(p)
        return list(groups.values())

    moving = {layer: [p for p in ps if p.name not in frozen] for layer, ps in by_layer.items()}
    opt = sum(seconds(ps, naive=False) for layer in moving.values() if layer for ps in collectives(layer))
    naive = sum(seconds([p], naive=True) for p in plan.params)
    return {
        "optimized": SwitchCost("optimized", [plan.min_bytes(r, frozen) for r in range(n)], plan.cross_node_bytes(skip=frozen), opt + copy,
                                sum(1 for ps in moving.values() if ps)),
        "naive": SwitchCost("naive", [plan.naive_bytes(r) for r in range(n)], plan.cross_node_bytes(naive=True), naive + copy, len(plan.params)),
    }


# Measured by bench/delta_sync.py (docs/hybrid_engine.md, "Delta weight sync"): async GRPO at lr 1e-6
# changed 0.4-4.4% of SmolLM2-135M's bf16 elements per step (1.3-2.9% of the tiny model's); in fp32
# nearly every element moves (91-99.7%). The `hybridflow plan` default per switch dtype.
MEASURED_CHANGED_FRACTION = {2: 0.02, 4: 1.0}


def delta_sync_bytes(plan: ReshardPlan, changed_fraction: float, r: int) -> int:
    """Bytes generation rank r fetches in a delta sync (`hybrid_engine/delta.py`) when a fraction
    `changed_fraction` of every piece's elements changed: per parameter piece the cheaper of the
    changed elements as int32 index + value pairs and the whole piece (what `delta.encode` picks)."""
    out = 0
    for p in plan.params:
        n = volume(p.need[r])
        out += min(n * p.itemsize, math.ceil(changed_fraction * n) * (4 + p.itemsize))
    return out


def memory_plan(plan: ReshardPlan, arch: Arch, layout: ParallelDims, m: MemoryInputs, rank: int) -> dict[str, int]:
    """Bytes rank `rank` holds, by part, and the two phases' peaks (module docstring)."""
    own = sum(volume(p.own[rank]) for p in plan.params)
    frozen = frozen_params(plan, m)
    trainable = sum(volume(p.own[rank]) for p in plan.params if p.name not in frozen)  # gradients and optimizer state
    if m.strategy == "SHARD_GRAD_OP":  # parameters stay unsharded between forward and backward
        held = own * layout.dp * (m.param_bytes + m.compute_bytes)
    else:
        held = own * m.param_bytes
    pp_i = layout.coords(rank)[0]
    layers = [p for p in plan.params if layer_stage(p.layer, arch.layers, layout.pp) == pp_i and p.layer.startswith("layers.")]
    # a layer as its forward gathers it: dp shards of each parameter (an expert weight: the dp / ep shards of its EP rank's experts)
    per_layer = sum(volume(p.own[rank]) * (layout.dp // layout.ep if layout.ep > 1 and is_expert_param(p.name) else layout.dp)
                    for p in layers) / max(1, arch.layers // layout.pp)
    unshard = 0 if m.strategy != "FULL_SHARD" else int(2 * per_layer * m.compute_bytes)  # current + prefetched layer
    s, b, h, L = math.ceil(m.seq_len / layout.sp), m.micro_batch, arch.hidden, arch.layers // layout.pp  # Ulysses: s / sp tokens per rank
    attention = "ulysses" if layout.sp > 1 else m.attention
    saved = [layer_activation_bytes(arch, b, s, m.compute_bytes, layout.tp, attention, m.packed, i) for i in range(pp_i * L, (pp_i + 1) * L)]
    # gradient checkpointing: each layer keeps its input [b, s, h]; backward recomputes one layer at a time
    acts = (L * s * b * h * m.compute_bytes + max(saved)) if m.gradient_checkpointing else sum(saved)
    acts *= layout.pp if pp_i == 0 else 1  # 1F1B: the first stage holds pp micro-batches' activations
    if pp_i == layout.pp - 1:  # the final norm (its weighted output is the head's input), the fp32 logits term: [tokens, V] plain, [chunk, V] chunked
        acts += b * s * (norm_bytes(h, m.compute_bytes) + h * m.compute_bytes) + train_logits_bytes(arch, m, layout.sp)
    gen_dp = plan.world_size // plan.gen_tp
    tokens = math.ceil(m.rollout_seqs / gen_dp) * m.seq_len
    kv = 2 * arch.layers * (arch.kv_heads // plan.gen_tp) * arch.head_dim * m.gen_bytes * tokens
    parts = {
        "params": 0 if m.param_offload else int(held),
        "grads": trainable * m.param_bytes,
        "optimizer": 0 if m.optimizer_offload else trainable * m.optim_bytes_per_param,
        "activations": int(acts),
        "fsdp_unshard": unshard,
        "gen_weights": plan.gen_buffer_bytes(rank),
        "kv_cache": kv,
    }
    parts["train_peak"] = parts["params"] + parts["grads"] + parts["optimizer"] + parts["activations"] + parts["fsdp_unshard"]
    parts["gen_peak"] = parts["params"] + parts["optimizer"] + parts["gen_weights"] + parts["kv_cache"]
    parts["peak"] = max(parts["train_peak"], parts["gen_peak"])
    return parts


def worst_memory(plan: ReshardPlan, arch: Arch, layout: ParallelDims, m: MemoryInputs) -> dict[str, int]:
    """The memory plan of the rank with the highest peak (one rank per distinct (pp, gen) position)."""
    return max((memory_plan(plan, arch, layout, m, r) for r in range(plan.world_size)), key=lambda d: d["peak"])


def naive_transient_bytes(plan: ReshardPlan) -> int:
    """The naive switch's extra: one layer's full tensors gathered at once (layer granularity)."""
    per_layer: dict[str, int] = {}
    for p in plan.params:
        per_layer[p.layer] = per_layer.get(p.layer, 0) + math.prod(p.shape) * p.itemsize
    return max(per_layer.values())


def rows(arch: Arch, layout: ParallelDims, gen_tp: int, cluster: Cluster, m: MemoryInputs, switch_dtype: str = "bf16",
         changed_fraction: float | None = None) -> list[dict]:
    """The `hybridflow plan` rows for one (training layout, gen_tp): one per mode. changed_fraction:
    of the elements between two syncs, for the delta sync's bytes (None: the measured default of the
    switch dtype, `MEASURED_CHANGED_FRACTION`)."""
    plan = plan_for(arch, layout, gen_tp, DTYPE_BYTES[switch_dtype], m.strategy, cluster.gpus_per_node, m.lora_rank)
    f = MEASURED_CHANGED_FRACTION.get(DTYPE_BYTES[switch_dtype], 1.0) if changed_fraction is None else changed_fraction
    delta = dict(delta_changed_fraction=f, full_sync_bytes_per_rank=max(plan.gen_buffer_bytes(r) for r in range(plan.world_size)),
                 delta_bytes_per_rank=max(delta_sync_bytes(plan, f, r) for r in range(plan.world_size)))
    mem = worst_memory(plan, arch, layout, m)
    first_switch = max(plan.min_bytes(r) for r in range(plan.world_size))
    staging = staging_plan(plan, m.buffer_percent)  # layer granularity, as the engine decides it
    out = []
    borrow = DTYPE_BYTES[switch_dtype] == m.param_bytes  # no cast: the own slices are the training shards
    for mode, cost in predict_switch(plan, cluster, frozen_params(plan, m), borrow).items():
        peak = mem["peak"] if mode == "optimized" else max(mem["train_peak"], mem["gen_peak"] + naive_transient_bytes(plan))
        out.append(dict(
            model=arch.name, train_layout=layout.label, sp=layout.sp, gen_tp=gen_tp, gen_dp=layout.world // gen_tp, mode=mode,
            bytes_per_rank=max(cost.bytes_per_rank), bytes_per_rank_mean=sum(cost.bytes_per_rank) / len(cost.bytes_per_rank),
            first_switch_bytes_per_rank=first_switch if mode == "optimized" else max(cost.bytes_per_rank), lora_rank=m.lora_rank,
            cross_node_bytes=cost.cross_node_bytes, predicted_seconds=cost.predicted_seconds, collectives=cost.collectives,
            memory_per_rank_bytes=peak, memory=mem, fits=peak <= cluster.memory_bytes, cluster=asdict(cluster),
            # the optimized switch's staging (the naive one has none): layers in flight, its bytes on the worst rank
            layers_in_flight=staging.slots if mode == "optimized" else 0, buffer_percent=m.buffer_percent, staging_note=staging.note,
            staging_bytes_per_rank=max(staging.staging_bytes(r) for r in range(plan.world_size)) if mode == "optimized" else 0,
            **delta,  # the cross-pool (async rollout) sync of these generation slices, whole and as a delta
            ep=layout.ep, total_params=arch.num_params(), active_params=arch.active_params(),
            expert_comm_modelled=not arch.experts or layout.pp == layout.tp == 1,  # TP / PP layouts move activations: not modelled
            **expert_comm(arch, layout, cluster, m),  # MoE: the experts' FSDP2 traffic and the tokens' all-to-all per step (0 if dense)
        ))
    return out
