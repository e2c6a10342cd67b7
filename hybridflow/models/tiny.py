"""Tiny HF checkpoints built fully offline (character tokenizer + random Qwen2/Llama, a
mixture-of-experts Qwen3-MoE / Mixtral / Qwen2-MoE: `models/moe.py`, or a vision-language
Qwen2-VL / Qwen2.5-VL with its processor: `models/vlm.py`).

The tokenizer is character level: every printable ASCII character (space included) and
"\\n" is exactly one token, so ``decode(encode(text)) == text`` for any such text.

Token ids (stable, independent of arguments):
    0 ``<|endoftext|>`` (pad; model bos_token_id)   1 ``<|im_start|>``   2 ``<|im_end|>`` (eos)
    3 ``"\\n"``   4..98 printable ASCII 32..126 (id = ord(c) - 28)   99..258 other bytes
Vocabulary size: 259 (byte-level BPE without merges; see ``build_char_tokenizer``).
"""

from __future__ import annotations

import argparse
import json
import pathlib

from hybridflow.models.vlm import VLM_ARCHS  # vision-language (models/vlm.py builds them with their processor)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
MOE_ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe"]  # mixture-of-experts (models/moe.py builds their configs)
ARCHS = ["qwen2", "llama", *MOE_ARCHS, *VLM_ARCHS]

# Same pre-tokenizer regex as Qwen2Tokenizer (transformers rebuilds this pipeline when a
# qwen2 checkpoint is loaded with AutoTokenizer, so we build the identical one up front).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The same template with a compact tool block (when ``tools=`` is given): one line per tool instead
# of the JSON schemas, so a tool conversation fits a tiny model's context (~150 tokens, not ~600).
# The agent loop passes tools to any template that renders them (hybridflow/agent/format.py).
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools: ' }}"
    "{% for tool in tools %}{{ tool['function']['name'] + '(' + (tool['function']['parameters']['properties'] | list | join(', ')) + ')' }}"
    "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}"
    "{{ '. Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n' }}{% endif %}"
    + CHAT_TEMPLATE
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / ByteLevel byte -> printable unicode char mapping."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
        range(ord("\xae"), ord("\xff") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _char_vocab() -> dict[str, int]:
    b2u = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    order = [10] + list(range(32, 127)) + [b for b in range(256) if b != 10 and not 32 <= b < 127]
    for b in order:
        vocab[b2u[b]] = len(vocab)
    return vocab


def build_char_tokenizer():
    """Character-level ``PreTrainedTokenizerFast`` with a Qwen-style chat template.

    Implemented as a byte-level BPE with *no merges*: every printable ASCII char and "\n" is
    one token; any other character falls back to its UTF-8 byte tokens (so there are no unknown
    tokens and decode(encode(text)) == text for all text). This is exactly the pipeline that
    ``Qwen2Tokenizer`` rebuilds on load, so the saved checkpoint tokenizes identically whether it
    is loaded as Qwen2Tokenizer (arch qwen2) or TokenizersBackend (arch llama).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _char_vocab()
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[],
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def make_tiny_model(
    out_dir,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    head_dim: int | None = None,
    reward: bool = False,
    tools_template: bool = False,
    vocab_size: int | None = None,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    shared_expert: bool = True,
) -> pathlib.Path:
    """Build a randomly initialised fp32 causal LM + char tokenizer and save both to ``out_dir``.

    reward=True builds a reward model instead: the same backbone with a one-label sequence
    classification head (``*ForSequenceClassification``, num_labels=1), pooled at the last non-pad token.

    head_dim (default hidden_size // num_attention_heads) lets the hidden size be any number, e.g.
    one that does not divide by the number of workers.

    tools_template=True saves ``TOOLS_CHAT_TEMPLATE`` (a compact tool block) as the chat template.

    vocab_size (default: the tokenizer's 259) gives the embedding and LM head a real model's shape
    (e.g. 151936 for a Qwen2.5-shaped one: bench/grpo_device.py); ids past the tokenizer's decode to nothing.

    arch qwen3_moe / mixtral / qwen2_moe: every layer a sparse block of `num_experts` experts,
    `num_experts_per_tok` per token, each expert intermediate_size // 2 wide (`models/moe.py::moe_config`);
    qwen2_moe adds its shared expert (intermediate_size wide) unless shared_expert=False. The model's
    own router_aux_loss_coef is 0: the trainer adds the aux loss from model.router_aux_loss_coef.

    arch qwen2_vl / qwen2_5_vl: the same text model under a 2-block vision tower, saved with its processor
    (small-image processor + this tokenizer with the vision tokens): `models/vlm.py::make_tiny_vlm`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig, LlamaConfig, Qwen2Config

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    pad_id = tok.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tok.convert_tokens_to_ids(IM_END)
    if vocab_size is not None and vocab_size < len(tok):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tok)}")
    common = dict(
        vocab_size=vocab_size or len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    if head_dim is not None:
        common["head_dim"] = head_dim
    arch_l = arch.lower()
    if arch_l in VLM_ARCHS:
        if reward or tools_template:
            raise ValueError(f"arch {arch!r}: reward models and the tools template are text-only")
        from hybridflow.models.vlm import make_tiny_vlm

        return make_tiny_vlm(out, arch_l, dict(common, vocab_size=vocab_size), tok, seed=seed)
    if arch_l == "qwen2":
        config = Qwen2Config(**common)
    elif arch_l == "llama":
        config = LlamaConfig(**common)
    elif arch_l in MOE_ARCHS:
        from hybridflow.models.moe import moe_config

        config = moe_config(arch_l, common, intermediate_size, num_experts, num_experts_per_tok, shared_expert)
    else:
        raise ValueError(f"unknown arch {arch!r}: expected one of {ARCHS}")
    config.dtype = torch.float32

    torch.manual_seed(seed)
    if reward:
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out)
    if tools_template:
        tok.chat_template = TOOLS_CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out


def main_make_model(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hybridflow make-model", description="Build a tiny offline HF checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--arch", default="qwen2", choices=ARCHS)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=None, help="default: 2 x hidden size")
    p.add_argument("--max-position-embeddings", type=int, default=256)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reward", action="store_true", help="a reward model: one-label sequence classifier on the same backbone")
    p.add_argument("--experts", type=int, default=4, help="MoE archs: experts per layer")
    p.add_argument("--experts-per-tok", type=int, default=2, help="MoE archs: experts each token is routed to (top-k)")
    p.add_argument("--no-shared-expert", action="store_true", help="qwen2_moe: leave out its shared expert")
    a = p.parse_args(argv)
    out = make_tiny_model(
        a.out_dir,
        arch=a.arch,
        hidden_size=a.hidden_size,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        intermediate_size=a.intermediate_size or 2 * a.hidden_size,
        max_position_embeddings=a.max_position_embeddings,
        tie_word_embeddings=a.tie_word_embeddings,
        seed=a.seed,
        reward=a.reward,
        num_experts=a.experts,
        num_experts_per_tok=a.experts_per_tok,
        shared_expert=not a.no_shared_expert,
    )
    print(json.dumps({"model_dir": str(out)}))
    return 0
