"""Model architectures for planning: built-in presets (architecture numbers only) and HF
``config.json`` files, turned into the exact parameter table (name -> shape) that
``AutoModelForCausalLM.from_config`` builds, without building it.

Families: llama (Llama 2/3, SmolLM2), mistral, qwen2 (q/k/v biases), qwen3 (per-head q/k norms), and the
mixture-of-experts ones (HF v5's layout, `models/moe.py`): qwen3_moe (q/k norms), mixtral, qwen2_moe (q/k/v
biases, a shared expert and its gate). A sparse layer's MLP is a router `mlp.gate.weight` [E, H] and the
experts `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I] (I = the expert width).
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass

from hybridflow.config.validate import A, register_check

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe")

# Numbers from the models' published config.json files.
PRESETS: dict[str, dict] = {
    "llama3-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "llama3-70b": dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False),
    "llama2-7b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=11008, vocab_size=32000, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-72b": dict(model_type="qwen2", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        intermediate_size=29568, vocab_size=152064, tie_word_embeddings=False),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class Arch:
    name: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    experts: int = 0  # routed experts per sparse layer (0: a dense model)
    top_k: int = 0  # experts per token
    expert_intermediate: int = 0  # one expert's width I
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert width (0: none)
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a plain MLP (Qwen's mlp_only_layers / decoder_sparse_step)

    @classmethod
    def from_config(cls, cfg: dict, name: str = "model") -> "Arch":
        mt = cfg.get("model_type", "llama")
        if mt not in FAMILIES:
            raise ValueError(f"{name}: model_type {mt!r} is not one the planner knows; supported: {', '.join(FAMILIES)}")
        heads = cfg["num_attention_heads"]
        attn_bias = bool(cfg.get("attention_bias", False))
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # HF v5 saves Qwen3-MoE's as num_local_experts
        moe = {}
        if experts and mt.endswith("moe") or mt == "mixtral":
            step, only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])
            moe = dict(experts=experts, top_k=cfg["num_experts_per_tok"],
                       expert_intermediate=cfg["intermediate_size"] if mt == "mixtral" else cfg["moe_intermediate_size"],
                       shared_intermediate=cfg.get("shared_expert_intermediate_size") or 0 if mt == "qwen2_moe" else 0,
                       dense_layers=tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step))
        return cls(name=name, model_type=mt, hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=heads,
                   kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"], tied=bool(cfg.get("tie_word_embeddings", False)),
                   qkv_bias=mt in ("qwen2", "qwen2_moe") or attn_bias, o_bias=attn_bias and mt not in ("qwen2", "qwen2_moe"),
                   mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=mt in ("qwen3", "qwen3_moe"), **moe)

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has an MoE block."""
        return self.experts > 0 and layer not in self.dense_layers

    def param_shapes(self, lora_rank: int = 0, lora_targets: tuple[str, ...] = ("all-linear",)) -> dict[str, tuple[int, ...]]:
        """{FQN: shape} in module order, as HF's ``*ForCausalLM`` registers them (tied head omitted).
        lora_rank > 0: each targeted projection X as peft injects it (models/lora.py): X.base_layer.weight
        (and bias), X.lora_A.default.weight [r, in], X.lora_B.default.weight [out, r]."""
        h, hd, q, kv = self.hidden, self.head_dim, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}

        def linear(prefix: str, proj: str, rows: int, cols: int, bias: bool) -> None:
            lora = lora_rank > 0 and ("all-linear" in lora_targets or proj in lora_targets)
            x = f"{prefix}.{proj}.base_layer" if lora else f"{prefix}.{proj}"
            out[f"{x}.weight"] = (rows, cols)
            if bias:
                out[f"{x}.bias"] = (rows,)
            if lora:
                out[f"{prefix}.{proj}.lora_A.default.weight"] = (lora_rank, cols)
                out[f"{prefix}.{proj}.lora_B.default.weight"] = (rows, lora_rank)

        for i in range(self.layers):
            a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            for proj, rows, bias in (("q_proj", q, self.qkv_bias), ("k_proj", kv, self.qkv_bias), ("v_proj", kv, self.qkv_bias),
                                     ("o_proj", h, self.o_bias)):
                linear(a, proj, rows, h if proj != "o_proj" else q, bias)
            if self.qk_norm:
                out[f"{a}.q_norm.weight"] = (hd,)
                out[f"{a}.k_norm.weight"] = (hd,)
            if self.sparse(i):  # HF v5's registration order: Qwen3-MoE lists the experts before the router
                e, ei = self.experts, self.expert_intermediate
                experts = {f"{m}.experts.gate_up_proj": (e, 2 * ei, h), f"{m}.experts.down_proj": (e, h, ei)}
                out.update({**experts, f"{m}.gate.weight": (e, h)} if self.model_type == "qwen3_moe" else {f"{m}.gate.weight": (e, h), **experts})
                if self.shared_intermediate:
                    si = self.shared_intermediate
                    for proj, (rows, cols) in (("gate_proj", (si, h)), ("up_proj", (si, h)), ("down_proj", (h, si))):
                        linear(f"{m}.shared_expert", proj, rows, cols, False)
                    out[f"{m}.shared_expert_gate.weight"] = (1, h)
            else:
                for proj, (rows, cols) in (("gate_proj", (self.intermediate, h)), ("up_proj", (self.intermediate, h)), ("down_proj", (h, self.intermediate))):
                    linear(m, proj, rows, cols, self.mlp_bias)
            out[f"model.layers.{i}.input_layernorm.weight"] = (h,)
            out[f"model.layers.{i}.post_attention_layernorm.weight"] = (h,)
        out["model.norm.weight"] = (h,)
        if not self.tied:
            out["lm_head.weight"] = (self.vocab, h)
        return out

    def num_params(self) -> int:
        n = 0
        for shape in self.param_shapes().values():
            size = 1
            for d in shape:
                size *= d
            n += size
        return n

    def expert_params(self) -> int:
        """Parameters of the routed experts (all sparse layers); 0 for a dense model."""
        return sum(self.experts * 3 * self.expert_intermediate * self.hidden for i in range(self.layers) if self.sparse(i))

    def active_params(self) -> int:
        """Parameters one token runs through: all but the routed experts, plus top_k / E of those."""
        return self.num_params() - self.expert_params() + (self.expert_params() * self.top_k // self.experts if self.experts else 0)


def load_arch(model: str) -> Arch:
    """A preset name, an HF checkpoint directory or a config.json path."""
    if model in PRESETS:
        return Arch.from_config(PRESETS[model], model)
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ValueError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory / config.json")
    with open(path) as f:
        return Arch.from_config(json.load(f), model)


@register_check("freeze_modules")
def freeze_problems(path: str, patterns: list[str]) -> list[str]:
    """The config validator's check: each actor.freeze_modules pattern names parameters of the model
    (from its config.json alone), and something stays trainable."""
    try:
        names = list(load_arch(path).param_shapes())
    except (ValueError, KeyError, OSError):
        return []  # the model checks report a missing or unknown checkpoint
    out = [f"{A}.freeze_modules: {pattern!r} matches no parameter of the model (names look like {names[0]!r}, "
           f"{names[-1]!r}); use fnmatch patterns such as '*embed_tokens*'"
           for pattern in patterns if not any(fnmatch.fnmatchcase(n, pattern) for n in names)]
    if all(any(fnmatch.fnmatchcase(n, pattern) for pattern in patterns) for n in names):
        out.append(f"{A}.freeze_modules freezes every parameter: nothing would train")
    return out
