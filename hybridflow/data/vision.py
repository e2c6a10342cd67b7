"""Image prompts: verl's multimodal parquet rows -> the processor's inputs, checked when the data is read.

Row shape (verl's): an ``images`` column next to ``prompt``, a list with one entry per ``<image>``
placeholder in the prompt's messages, in order. An entry is ``{"bytes": b"...", "path": ...}`` (what
``datasets.Image`` writes; bytes win when both are set), raw ``bytes``, or a path string; a relative path
is taken from the parquet file's directory. Every image is decoded and every row run through the
processor in ``VisionRLDataset.__init__``: a missing file, undecodable bytes, or a count of placeholders
that differs from the count of images raises one ``DataError`` line naming the file and row, before any
worker starts (a text-only model's dataset, `data/dataset.py::RLDataset`, refuses a row with images).

What travels in `Batch` (verl's names):
- ``input_ids`` / ``attention_mask`` [B, L]: left-padded, the image placeholders expanded by the processor
  (one ``<|image_pad|>`` per merged patch: grid_t * grid_h * grid_w / merge_size**2);
- ``position_ids`` [B, 3, L]: Qwen2-VL's M-RoPE index (temporal, height, width; text tokens have the same
  value in all three; pads 0). The HF model takes it as [3, B, L]: ``position_ids.transpose(0, 1)``;
- non-tensor ``multi_modal_inputs``: per row ``{"pixel_values": [P_i, C * T * patch**2], "image_grid_thw": [n_i, 3]}``
  (``{}`` for a row without images); `pack_multi_modal_inputs` concatenates a micro-batch's rows in order,
  which is the layout the model's forward takes;
- non-tensor ``multi_modal_data`` (verl's): per row ``{"image": [PIL.Image, ...]}``, the decoded images, which a multi-turn
  rollout renders the prompt from with its tool schemas (read on the driver; no worker stage selects it).

Simplified: images only (no video); the pixel inputs are computed once when the data is read and kept in
memory (fine for the small images of the built-in task; a large image set would process lazily).
"""

from __future__ import annotations

import io
import os
from typing import Any, Sequence

import torch

from hybridflow.data.dataset import SFT_REQUIRED, DataError, RLDataset, SFTDataset, _check_chat, collate_rl, collate_sft, text_ids
from hybridflow.protocol import Batch

IMAGE_PLACEHOLDER = "<image>"
MULTI_MODAL_KEY = "multi_modal_inputs"
# verl's key of a row's decoded images ({"image": [PIL.Image, ...]}, in placeholder order): what a multi-turn rollout
# renders the row's prompt from (with the tool schemas), on the driver only (no stage sends it to a worker)
RAW_IMAGES_KEY = "multi_modal_data"


# ------------------------------------------------------------------------------------------ images
def load_image(value: Any, file: str, row_no: int, j: int):
    """One ``images`` entry -> an RGB ``PIL.Image`` (decoded now), or a DataError naming file, row and image."""
    from PIL import Image

    where = f"{file} row {row_no}: image {j}"
    path = None
    data = None
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
    elif isinstance(value, (bytes, bytearray)):
        data = value
    elif isinstance(value, (str, os.PathLike)):
        path = value
    elif isinstance(value, Image.Image):
        return value.convert("RGB")
    else:
        raise DataError(f"{where}: expected {{'bytes', 'path'}}, bytes or a path, got {type(value).__name__}")
    src = f"{len(data)} bytes" if data is not None else f"file {path}"
    if data is None:
        if not path:
            raise DataError(f"{where}: neither 'bytes' nor 'path' is set")
        full = path if os.path.isabs(path) else os.path.join(os.path.dirname(os.path.abspath(file)), path)
        if not os.path.isfile(full):
            raise DataError(f"{where}: image file not found: {full}")
        try:
            with open(full, "rb") as fh:
                data = fh.read()
        except OSError as e:
            raise DataError(f"{where}: cannot read image file {full}: {e}") from e
    try:
        # raster formats only: the data is untrusted, and Pillow's other decoders include EPS (an external Ghostscript process)
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        img.load()  # decode now, not inside a training step
    except Exception as e:  # noqa: BLE001 - re-raised with file and row
        raise DataError(f"{where}: cannot decode image ({src}): {type(e).__name__}: {e}") from e
    return img.convert("RGB")


IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def count_placeholders(messages: Sequence[dict]) -> int:
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m.get("content"), str))


def vision_messages(messages: Sequence[dict]) -> list[dict]:
    """verl's ``<image>`` placeholders -> the processor's content lists: "a<image>b" ->
    [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}] (empty texts dropped);
    a message without a placeholder keeps its string content."""
    out = []
    for m in messages:
        content = m["content"]
        if IMAGE_PLACEHOLDER not in content:
            out.append({"role": m["role"], "content": content})
            continue
        parts: list[dict] = []
        for k, seg in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if k:
                parts.append({"type": "image"})
            if seg:
                parts.append({"type": "text", "text": seg})
        out.append({"role": m["role"], "content": parts})
    return out


def row_images(file: str, row_no: int, row: dict, messages: Sequence[dict], image_key: str = "images") -> list:
    """The row's decoded images, checked against its ``<image>`` placeholders (one line naming file and row)."""
    raw = row.get(image_key)
    raw = list(raw) if raw is not None else []
    n_ph = count_placeholders(messages)
    if n_ph != len(raw):
        more = "more" if n_ph > len(raw) else "fewer"
        raise DataError(f"{file} row {row_no}: the prompt has {n_ph} {IMAGE_PLACEHOLDER} placeholder(s), {more} than "
                        f"the {len(raw)} image(s) in column {image_key!r}; they must match one to one, in order")
    return [load_image(v, file, row_no, j) for j, v in enumerate(raw)]


def encode_vision_prompt(processor, messages: Sequence[dict], images: Sequence) -> dict[str, Any]:
    """Chat messages with ``<image>`` placeholders + their images -> ``{"input_ids": list[int],
    "multi_modal_inputs": {"pixel_values": [P, C*T*patch**2], "image_grid_thw": [n, 3]} or {}}``
    (the processor's own expansion of the image tokens; the generation prompt appended)."""
    text = processor.apply_chat_template(vision_messages(messages), add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=list(images) or None, return_tensors="pt")
    mm = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]} if images else {}
    return {"input_ids": [int(x) for x in enc["input_ids"][0]], MULTI_MODAL_KEY: mm}


# ----------------------------------------------------------------------------------- position ids
def _rope_model_class(config):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    classes = {"qwen2_vl": Qwen2VLModel, "qwen2_5_vl": Qwen2_5_VLModel}
    if config.model_type not in classes:
        raise ValueError(f"no M-RoPE index for model_type {config.model_type!r} (known: {sorted(classes)})")
    return classes[config.model_type]


def mrope_position_ids(config, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """Qwen2-VL's 3-D rope index, computed by the model class's own ``get_rope_index`` (no weights needed).

    input_ids, attention_mask: [B, L]; image_grid_thw: [N, 3] for the batch's N images in row order.
    Returns [B, 3, L] (verl's layout; the model takes [3, B, L])."""
    cls = _rope_model_class(config)

    class _Shim:  # get_rope_index only reads self.config and calls self.get_vision_position_ids
        get_vision_position_ids = cls.get_vision_position_ids

    shim = _Shim()
    shim.config = config
    mm_token_type_ids = (input_ids == config.image_token_id).long()  # text 0, image 1 (the processor's mm_token_type_ids)
    pos, _deltas = cls.get_rope_index(shim, input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=image_grid_thw,
                                      attention_mask=attention_mask)  # [3, B, L]
    return pos.transpose(0, 1).contiguous()  # [B, 3, L]


def rows_position_ids(config, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: Sequence[dict]) -> torch.Tensor:
    """`mrope_position_ids` [B, 3, L] of sequences whose per-row image inputs are ``rows`` (``multi_modal_inputs``):
    e.g. prompt + response after generation (the response's text positions continue after the prompt's)."""
    return mrope_position_ids(config, input_ids, attention_mask, pack_multi_modal_inputs(rows).get("image_grid_thw"))


def pack_multi_modal_inputs(rows: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Per-row ``multi_modal_inputs`` -> one forward's kwargs: pixel_values [sum P_i, D], image_grid_thw [sum n_i, 3]
    (rows concatenated in order, as the model matches images to ``<|image_pad|>`` runs left to right); {} if no images."""
    rows = [r for r in rows if r]
    if not rows:
        return {}
    return {"pixel_values": torch.cat([r["pixel_values"] for r in rows]), "image_grid_thw": torch.cat([r["image_grid_thw"] for r in rows])}


# ------------------------------------------------------------------------------------------ dataset
class VisionRLDataset(RLDataset):
    """`RLDataset` for a vision-language model: each row's images are decoded and run through the
    processor when the dataset is built. ``truncation`` left/right would cut image tokens, so over-long
    prompts are filtered (``filter_overlong_prompts``) or refused (truncation "error")."""

    def __init__(self, files, processor, max_prompt_length: int, prompt_key: str = "prompt", filter_overlong_prompts: bool = True,
                 truncation: str = "error", image_key: str = "images"):
        if not filter_overlong_prompts and truncation != "error":
            raise DataError(f"data.truncation={truncation!r} would cut image tokens out of a prompt; with images set "
                            f"data.filter_overlong_prompts=true or data.truncation=error")
        self.processor = processor
        self.image_key = image_key
        super().__init__(files, processor.tokenizer, max_prompt_length, prompt_key, filter_overlong_prompts, truncation)

    def encode_prompt(self, file: str, row_no: int, row: dict, rec: dict) -> dict[str, Any]:
        images = row_images(file, row_no, row, rec["prompt"], self.image_key)
        try:
            return {**encode_vision_prompt(self.processor, rec["prompt"], images), RAW_IMAGES_KEY: {"image": images}}
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - the processor's error, with file and row
            raise DataError(f"{file} row {row_no}: the processor refused the row: {type(e).__name__}: {e}") from e


def collate_vision(items: list[dict], pad_token_id: int, max_prompt_length: int, model_config, padding: str = "max_length") -> Batch:
    """`collate_rl` + the image inputs: position_ids becomes the M-RoPE index [B, 3, L] and each row's
    ``multi_modal_inputs`` rides as a non-tensor."""
    batch = collate_rl(items, pad_token_id, max_prompt_length, padding)
    mm = [it.get(MULTI_MODAL_KEY) or {} for it in items]
    grid = pack_multi_modal_inputs(mm).get("image_grid_thw")
    batch["position_ids"] = mrope_position_ids(model_config, batch["input_ids"], batch["attention_mask"], grid)
    batch[MULTI_MODAL_KEY] = mm
    batch[RAW_IMAGES_KEY] = [it.get(RAW_IMAGES_KEY) or {"image": []} for it in items]
    return batch


# ---------------------------------------------------------------------------------------------- SFT
class VisionSFTDataset(SFTDataset):
    """`SFTDataset` rows with images (verl's multimodal SFT shape: ``images`` next to ``prompt`` / ``response``):
    ids = the processor's prompt (image tokens expanded) + response + eos, right-padded to max_length; truncation
    cuts the response only (a prompt that leaves no room is refused), so image tokens are never cut. Each item
    also carries its row's ``multi_modal_inputs``; `collate_vision_sft` adds the M-RoPE position ids."""

    def __init__(self, files, processor, max_length: int, prompt_key: str = "prompt", response_key: str = "response", image_key: str = "images"):
        self.processor, self.image_key = processor, image_key
        self.multi_modal: list[dict] = []  # per sample, in SFTDataset.samples' order (encode_row runs once per row, in order)
        super().__init__(files, processor.tokenizer, max_length, prompt_key, response_key)

    def encode_row(self, file: str, row_no: int, row: dict) -> tuple[list[int], list[int]]:
        prompt = _check_chat(file, row_no, row, self.prompt_key, SFT_REQUIRED)
        response = row.get(self.response_key)
        if not isinstance(response, str):
            raise DataError(f"{file} row {row_no}: column {self.response_key!r} must be a string ({SFT_REQUIRED})")
        images = row_images(file, row_no, row, prompt, self.image_key)
        try:
            enc = encode_vision_prompt(self.processor, prompt, images)
        except Exception as e:  # noqa: BLE001 - the processor's error, with file and row
            raise DataError(f"{file} row {row_no}: the processor refused the row: {type(e).__name__}: {e}") from e
        self.multi_modal.append(enc[MULTI_MODAL_KEY])
        r_ids = text_ids(self.tokenizer, response) + [self.eos_token_id]
        return enc["input_ids"] + r_ids, [0] * len(enc["input_ids"]) + [1] * len(r_ids)

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), MULTI_MODAL_KEY: self.multi_modal[i]}


def collate_vision_sft(items: list[dict], model_config) -> Batch:
    """`collate_sft` of `VisionSFTDataset` items: input_ids / attention_mask / loss_mask [B, L] (right-padded), the
    M-RoPE position_ids [B, 3, L] and the rows' image inputs (non-tensor ``multi_modal_inputs``)."""
    mm = [it[MULTI_MODAL_KEY] for it in items]
    batch = collate_sft([{k: v for k, v in it.items() if k != MULTI_MODAL_KEY} for it in items])
    batch["position_ids"] = rows_position_ids(model_config, batch["input_ids"], batch["attention_mask"], mm)
    batch[MULTI_MODAL_KEY] = mm
    return batch
