"""Tiny vision-language checkpoints built fully offline: a random Qwen2-VL / Qwen2.5-VL with a small
vision tower, the character tokenizer of `models/tiny.py` extended with the model's vision tokens, and
a Qwen2-VL image processor configured for small images (28-56 px: 1-4 image tokens per image).

Simplifications (and why):
- The image processor is the PIL backend (``Qwen2VLImageProcessorPil``): torchvision is not installed
  here, and the PIL one gives the same ``pixel_values`` / ``image_grid_thw`` layout.
- No video processor: the processor saves without one (images only); video inputs are out of scope.
- The chat template is the text one (`tiny.CHAT_TEMPLATE`) extended to content lists: an
  ``{"type": "image"}`` part renders as ``<|vision_start|><|image_pad|><|vision_end|>``, which the
  processor then expands to one ``<|image_pad|>`` per merged patch (grid_t * grid_h * grid_w / merge**2).

Token ids: the text ids of `models/tiny.py` (0..258) are unchanged; the vision tokens follow:
    259 ``<|vision_start|>``   260 ``<|vision_end|>``   261 ``<|image_pad|>``   262 ``<|video_pad|>``
"""

from __future__ import annotations

import pathlib

VLM_ARCHS = ["qwen2_vl", "qwen2_5_vl"]
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
IMAGE_PLACEHOLDER = "<image>"  # verl's placeholder in a data row's message content

# The text template (models/tiny.py::CHAT_TEMPLATE) where a message's content may also be a list of
# {"type": "text", "text": ...} / {"type": "image"} parts (the processor's and OpenAI's shape).
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_vlm_tokenizer(tok):
    """The char tokenizer ``tok`` (`tiny.build_char_tokenizer`, extended in place) with the four vision tokens
    appended as special tokens and the content-list chat template."""
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    tok.chat_template = VLM_CHAT_TEMPLATE
    return tok


def build_image_processor(min_pixels: int = 28 * 28, max_pixels: int = 56 * 56, patch_size: int = 14, merge_size: int = 2):
    """Qwen2-VL's image processor for small images: each side is rounded to a multiple of
    patch_size * merge_size (28) with the area kept in [min_pixels, max_pixels] (28x28 -> 1 image token,
    56x56 -> 4)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=patch_size, temporal_patch_size=2, merge_size=merge_size
    )


def build_processor(tok, min_pixels: int = 28 * 28, max_pixels: int = 56 * 56):
    """`TinyVLProcessor` = the small-image processor + the char tokenizer ``tok`` with the vision tokens (no video processor)."""
    from hybridflow.models.vlm_processor import TinyVLProcessor

    return TinyVLProcessor(image_processor=build_image_processor(min_pixels, max_pixels), tokenizer=build_vlm_tokenizer(tok),
                           chat_template=VLM_CHAT_TEMPLATE)


def load_processor(model_dir):
    """``AutoProcessor.from_pretrained(model_dir)`` with `TinyVLProcessor` registered (importing
    `models/vlm_processor.py` registers it), so the tiny checkpoints load like any HF VLM's."""
    import hybridflow.models.vlm_processor  # noqa: F401 - registers TinyVLProcessor with AutoProcessor
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir))


def vlm_config(arch: str, common: dict, tok, vision_depth: int = 2, vision_embed_dim: int = 32, vision_heads: int = 2):
    """A Qwen2-VL / Qwen2.5-VL config around the text settings ``common`` (models/tiny.py's dict).

    M-RoPE splits each head's rotary half (head_dim // 2 frequencies) into temporal / height / width
    sections; the tiny head_dim 16 gives 8 = [2, 3, 3]."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    head_dim = common.get("head_dim") or common["hidden_size"] // common["num_attention_heads"]
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    mrope_section = [t, h, half - t - h]  # sums to head_dim // 2
    text = dict(common, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": mrope_section})
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in
           (("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END), ("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD))}
    vision = dict(depth=vision_depth, embed_dim=vision_embed_dim, hidden_size=common["hidden_size"], num_heads=vision_heads,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if arch == "qwen2_vl":
        vision["mlp_ratio"] = 2
        return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=common["tie_word_embeddings"], **ids)
    if arch == "qwen2_5_vl":
        # Qwen2.5-VL's tower: SwiGLU blocks, window attention except in fullatt_block_indexes; out_hidden_size feeds the LM.
        vision = dict(vision, hidden_size=vision_embed_dim, out_hidden_size=common["hidden_size"], intermediate_size=2 * vision_embed_dim,
                      window_size=56, fullatt_block_indexes=[vision_depth - 1])
        vision.pop("embed_dim")
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=common["tie_word_embeddings"], **ids)
    raise ValueError(f"unknown VLM arch {arch!r}: expected one of {VLM_ARCHS}")


def make_tiny_vlm(out_dir, arch: str, common: dict, tok, seed: int = 0, min_pixels: int = 28 * 28, max_pixels: int = 56 * 56) -> pathlib.Path:
    """Build a random fp32 tiny VLM (text settings ``common`` and char tokenizer ``tok`` from `tiny.make_tiny_model`,
    which this module does not import) and save it with its processor to ``out_dir``; load back with
    ``AutoModelForImageTextToText`` / `load_processor` (``AutoProcessor``)."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    processor = build_processor(tok, min_pixels, max_pixels)
    pad_id, eos_id = common["pad_token_id"], common["eos_token_id"]
    if common.get("vocab_size") is None or common["vocab_size"] < len(tok):
        common = dict(common, vocab_size=len(tok))  # 263: the char vocabulary + 4 vision tokens
    config = vlm_config(arch, common, tok)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def is_vlm_dir(model_dir) -> bool:
    """True when ``model_dir`` holds an image processor's config (a VLM checkpoint's processor: transformers v5
    nests it in processor_config.json, v4 wrote preprocessor_config.json)."""
    import json

    d = pathlib.Path(model_dir)
    if (d / "preprocessor_config.json").is_file():
        return True
    f = d / "processor_config.json"
    return f.is_file() and "image_processor" in json.loads(f.read_text())


# ------------------------------------------------------------------------ what the RL trainer reads
def prompt_dataset(files, tokenizer, model_path: str, max_prompt_length: int, prompt_key: str = "prompt", filter_overlong_prompts: bool = True,
                   truncation: str = "error"):
    """The prompts of an RL run: `RLDataset` for a text model, `VisionRLDataset` (with the checkpoint's processor)
    for a vision-language one (`models/vlm.py::is_vlm_dir`)."""
    from hybridflow.data.dataset import RLDataset
    from hybridflow.data.vision import VisionRLDataset

    if not is_vlm_dir(model_path):
        return RLDataset(files, tokenizer, max_prompt_length, prompt_key, filter_overlong_prompts, truncation)
    return VisionRLDataset(files, load_processor(model_path), max_prompt_length, prompt_key, filter_overlong_prompts, truncation)


def prompt_collate(pad_token_id: int, model_path: str, max_prompt_length: int, padding: str = "max_length"):
    """items -> Batch: `collate_rl`, or `collate_vision` (M-RoPE position ids, the rows' image inputs) for a VLM."""
    from hybridflow.data.dataset import collate_rl
    from hybridflow.data.vision import collate_vision

    if not is_vlm_dir(model_path):
        return lambda items: collate_rl(items, pad_token_id, max_prompt_length, padding)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    return lambda items: collate_vision(items, pad_token_id, max_prompt_length, config, padding)


def image_keys(model_path: str) -> list[str]:
    """The batch keys a VLM's stages carry beside the text ones ([] for a text model): the rows' image inputs."""
    from hybridflow.data.vision import MULTI_MODAL_KEY

    return [MULTI_MODAL_KEY] if is_vlm_dir(model_path) else []


def sft_data(files, model_path: str, max_length: int, prompt_key: str = "prompt", response_key: str = "response"):
    """(dataset, collate) of an SFT run on a vision-language model (`data/vision.py::VisionSFTDataset`), None for a text model."""
    if not is_vlm_dir(model_path):
        return None
    from transformers import AutoConfig

    from hybridflow.data.vision import VisionSFTDataset, collate_vision_sft

    config = AutoConfig.from_pretrained(model_path)
    return VisionSFTDataset(files, load_processor(model_path), max_length, prompt_key, response_key), lambda items: collate_vision_sft(items, config)


def save_processor(model_path: str, out_dir: str) -> None:
    """A trained VLM's checkpoint keeps its processor (the weights' writer saves the tokenizer only); no-op for a text model."""
    if is_vlm_dir(model_path):
        load_processor(model_path).save_pretrained(str(out_dir))
