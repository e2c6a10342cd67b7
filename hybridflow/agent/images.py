"""Images in multi-turn trajectories: messages whose content holds image parts -> the processor's tokens and pixel inputs.

A tool or environment message (a ``render`` tool's screenshot, a user's photo through the OpenAI-compatible
endpoint) may carry images as content parts next to its text:

    {"role": "tool", "content": [{"type": "image", "image": <PIL.Image or PNG/JPEG/... bytes>}, {"type": "text", "text": "..."}]}
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]}   # OpenAI's shape

Such a message is tokenised as the model's processor does it for the whole conversation: the chat template renders each
image part as its vision block (Qwen2-VL: ``<|vision_start|><|image_pad|><|vision_end|>``), and the processor expands the
block's ``<|image_pad|>`` into one per merged patch (grid_t * grid_h * grid_w / merge_size**2) and returns the image's
``pixel_values`` [P, D] and ``image_grid_thw`` [n, 3]. The delta of a message appended after the model's turn is measured
as `format.message_delta_ids` measures text: ``processor(template(base + msgs)) - processor(template(base))`` on the fixed
conversation ``format.DELTA_BASE``, so the image's tokens are exactly the ones the processor gives in place. The template
is the tokenizer's (the one `format.py` renders text with), so it must render image parts (Qwen2-VL's and the tiny VLM's do).

Images are untrusted input: bytes are opened as raster formats only (`data/vision.py::IMAGE_FORMATS`; Pillow's EPS decoder
would run Ghostscript), a data URL must be base64, and an image over `MAX_IMAGE_PIXELS` is refused before it is decoded.
A remote (http, https) URL is never fetched: `ImageError` says to send a data URL instead.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from typing import Any, Mapping, Sequence

from hybridflow.data.vision import IMAGE_FORMATS, IMAGE_PLACEHOLDER, pack_multi_modal_inputs, vision_messages

__all__ = ["ImageError", "MAX_IMAGE_PIXELS", "decode_image", "has_images", "image_digest", "is_image_part", "placeholder_messages",
           "render_with_images", "split_images", "trajectory_image_inputs"]

# width * height of one image, checked from its header before it is decoded: a 1 MB PNG can hold 100M+ pixels of zeros
MAX_IMAGE_PIXELS = 4096 * 4096
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,(?P<data>.*)", re.DOTALL)


class ImageError(ValueError):
    """An image part that cannot be used: its message says why (the endpoint answers it as a 400 naming the field)."""


def is_image_part(part: Any) -> bool:
    """An image content part: ``{"type": "image", ...}`` (the processor's) or ``{"type": "image_url", ...}`` (OpenAI's)."""
    return isinstance(part, Mapping) and part.get("type") in ("image", "image_url")


def has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(is_image_part(p) for p in m["content"]) for m in messages)


def decode_image(value: Any):
    """An image part's value -> an RGB ``PIL.Image``: a PIL image, raw bytes, a data URL string, or OpenAI's
    ``{"url": ...}``. ImageError (a readable line) for a remote URL, bad base64, bytes that are no raster image, or an image
    over MAX_IMAGE_PIXELS."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return _bounded(value).convert("RGB")
    if isinstance(value, Mapping):
        value = value.get("url")
    if isinstance(value, str):
        value = _data_url_bytes(value)
    if not isinstance(value, (bytes, bytearray)):
        raise ImageError(f"expected image bytes, a data URL or a PIL image, got {type(value).__name__}")
    try:
        img = Image.open(io.BytesIO(value), formats=IMAGE_FORMATS)  # reads the header only
    except Exception as e:  # noqa: BLE001 - any decoder failure is the sender's bad input
        raise ImageError(f"cannot decode the image ({len(value)} bytes; raster formats only: {', '.join(IMAGE_FORMATS)}): "
                         f"{type(e).__name__}: {e}"[:300]) from None
    _bounded(img)
    try:
        img.load()  # decode now, not in a generate call
    except Exception as e:  # noqa: BLE001
        raise ImageError(f"cannot decode the image ({len(value)} bytes): {type(e).__name__}: {e}"[:300]) from None
    return img.convert("RGB")


def _bounded(img):
    w, h = img.size
    if w * h > MAX_IMAGE_PIXELS or w < 1 or h < 1:
        raise ImageError(f"the image is {w}x{h} pixels; at most {MAX_IMAGE_PIXELS} pixels in all are taken")
    return img


def _data_url_bytes(url: str) -> bytes:
    if re.match(r"(?i)\s*(https?|ftp|file)://", url):
        raise ImageError("remote image URLs are not fetched (the rollout reaches no network); send the image inline as a "
                         "data URL: data:image/png;base64,<base64 of the file>")
    m = _DATA_URL.fullmatch(url.strip())
    if m is None:
        raise ImageError("an image URL must be a data URL (data:image/png;base64,...)")
    if not m.group("b64"):
        raise ImageError("a data URL image must be base64-encoded (data:image/...;base64,...)")
    if m.group("mime") and not m.group("mime").lower().startswith("image/"):
        raise ImageError(f"the data URL's media type is {m.group('mime')!r}, not an image")
    try:
        return base64.b64decode(m.group("data"), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"the data URL's base64 is invalid: {e}") from None


def image_digest(value: Any) -> str:
    """What identifies an image part's image when a client sends the conversation again (sha256 of its URL or bytes)."""
    from PIL import Image

    if isinstance(value, Mapping):
        value = value.get("url", "")
    if isinstance(value, Image.Image):
        value = value.tobytes() + repr((value.mode, value.size)).encode()
    if isinstance(value, str):
        value = value.encode()
    return hashlib.sha256(bytes(value)).hexdigest()[:32]


def split_images(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict], list]:
    """Messages with image parts -> (what the chat template renders: each image part as ``{"type": "image"}``, the images
    as RGB PIL images in the order their parts appear). ImageError from `decode_image`."""
    out, images = [], []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list) or not any(is_image_part(p) for p in content):
            out.append(dict(m))
            continue
        parts = []
        for p in content:
            if is_image_part(p):
                images.append(decode_image(p.get("image", p.get("image_url"))))
                parts.append({"type": "image"})
            else:
                parts.append(dict(p))
        out.append({**m, "content": parts})
    return out, images


def render_with_images(processor, text: str, images: Sequence) -> tuple[list[int], dict]:
    """The processor on a rendered conversation ``text`` and its images in order -> (input_ids with each image's
    ``<|image_pad|>`` expanded to its merged patches, {"pixel_values": [P, D], "image_grid_thw": [n, 3]}; {} without images).

    ImageError when the text holds another number of image tokens than there are images: a message's own text that
    spells ``<|image_pad|>`` would otherwise become a token with no pixels behind it, and every forward over it fails."""
    token = getattr(processor, "image_token", None) or "<|image_pad|>"
    if text.count(token) != len(images):
        raise ImageError(f"the conversation holds {text.count(token)} image token(s) {token!r} for {len(images)} image(s): "
                         f"text may not contain the model's image token")
    enc = processor(text=[text], images=list(images) or None, return_tensors="pt")
    mm = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]} if images else {}
    return [int(x) for x in enc["input_ids"][0]], mm


def trajectory_image_inputs(image_inputs: Sequence[tuple[int, dict]]) -> dict:
    """A trajectory's images (`Trajectory.image_inputs`: (where, pixel inputs) per message, in order) as one row of the
    batch's ``multi_modal_inputs``: {"pixel_values": [sum P, D], "image_grid_thw": [n, 3]}, {} without images."""
    return pack_multi_modal_inputs([mm for _, mm in image_inputs])


def placeholder_messages(messages: Sequence[Mapping[str, Any]], images: Sequence) -> list[dict]:
    """A data row's prompt in verl's multimodal shape (``<image>`` placeholders in string contents, the row's ``images`` in
    order) -> messages whose image parts carry their image (``{"type": "image", "image": <PIL image>}``), what the agent
    loop tokenises through the processor. A row without placeholders comes back unchanged. ImageError when the counts
    differ (the dataset checks them when it reads the rows; this guards a batch built by hand)."""
    n = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m.get("content"), str))
    if n != len(images):
        raise ImageError(f"the prompt has {n} {IMAGE_PLACEHOLDER} placeholder(s) for {len(images)} image(s)")
    if not n:
        return [dict(m) for m in messages]
    it = iter(images)
    out = []
    for m in messages:
        if not isinstance(m.get("content"), str) or IMAGE_PLACEHOLDER not in m["content"]:
            out.append(dict(m))
            continue
        split = vision_messages([m])[0]["content"]  # "a<image>b" -> text, image, text parts
        out.append({**m, "content": [dict(p, image=next(it)) if p["type"] == "image" else p for p in split]})
    return out
