"""``vision_colour``: a synthetic visual task a tiny VLM can learn on CPU.

Each image (56 x 56 px: 4 image tokens for the tiny Qwen2-VL) is a white canvas with one filled circle
of one of four colours, at a random position and radius; the prompt is ``"<image>Which colour is the
circle?"`` and the answer is the colour's name. The RL files (``train.parquet``, ``val.parquet``: verl's
multimodal rows, the PNG in an ``images`` column) are drawn from different seeds, so the held-out images
are new ones. ``sft.parquet`` holds demonstrations over the train images that follow a WRONG rule with
probability ``bias_prob``: they name the NEXT colour of the palette cycle (red -> green -> blue ->
yellow -> red), a systematic error like the text demos' (hybridflow/data/tasks.py): the SFT model learns
it, and GRPO with the exact-answer reward (`rewards/vision.py`) is what removes it.

The images are exact: no anti-aliasing, so every pixel is either white or exactly the circle's colour
(tests count them).

``vision_render`` (`make_vision_render_task`, multi-turn with images): the prompt's image shows the circle in grey
(``HIDDEN``), so the colour cannot be read from it; the model may call the ``render`` tool (`agent/tools.py::RenderTool`,
configured by the written ``tool_config.yaml``; the row's ``tools_kwargs`` hold the circle), whose tool message carries the
coloured canvas as an image. The reward is the same exact answer (data source ``vision_colour``).
"""

from __future__ import annotations

import io
import pathlib
import random

VISION_DATA_SOURCE = "vision_colour"
COLOURS: dict[str, tuple[int, int, int]] = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
BACKGROUND = (255, 255, 255)
QUESTION = "<image>Which colour is the circle?"
HIDDEN = (128, 128, 128)  # vision_render: the prompt's circle, before the render tool shows its colour
RENDER_QUESTION = "<image>The circle is grey here. Call render to see its colour, then say which colour it is."


def wrong_colour(colour: str) -> str:
    """The SFT demonstrations' wrong rule: the next colour of the palette cycle."""
    names = list(COLOURS)
    return names[(names.index(colour) + 1) % len(names)]


def draw_circle(colour: str, cx: int, cy: int, r: int, size: int = 56, fill: tuple[int, int, int] | None = None):
    """A ``size`` x ``size`` RGB image: white, one filled circle of ``COLOURS[colour]`` (or ``fill``) (pixel centres within r of (cx, cy))."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), BACKGROUND)
    ImageDraw.Draw(img).ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill or COLOURS[colour])
    return img


def write_parquet(rows: list[dict], path) -> pathlib.Path:
    """``data/tasks.py::write_parquet`` (not imported: tasks.py imports this module for ``make-data --task vision``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _draw_sample(rng: random.Random, size: int) -> tuple[str, dict, object]:
    colour = rng.choice(list(COLOURS))
    r = rng.randint(size // 7, size // 3)
    cx, cy = rng.randint(r, size - 1 - r), rng.randint(r, size - 1 - r)
    return colour, {"cx": cx, "cy": cy, "r": r}, draw_circle(colour, cx, cy, r, size)


def make_vision_task(out_dir, n_train: int = 256, n_val: int = 64, sft_copies: int = 2, bias_prob: float = 0.75, size: int = 56,
                     seed: int = 0) -> dict[str, pathlib.Path]:
    """Write ``train.parquet`` / ``val.parquet`` (RL rows with images) and ``sft.parquet`` (prompt + images + response)."""
    if not 0.0 <= bias_prob <= 1.0:
        raise ValueError(f"bias_prob must be in [0, 1], got {bias_prob}")
    if size < 28:
        raise ValueError(f"size must be >= 28 px (one 28 x 28 merged patch), got {size}")
    out = pathlib.Path(out_dir)
    prompt = [{"role": "user", "content": QUESTION}]

    def samples(split: str, n: int, split_seed: int) -> list[tuple[str, dict, bytes]]:
        rng = random.Random(split_seed)
        return [(c, geo, png_bytes(img)) for c, geo, img in (_draw_sample(rng, size) for _ in range(n))]

    def rl_rows(split: str, drawn) -> list[dict]:
        return [{"data_source": VISION_DATA_SOURCE, "prompt": prompt, "images": [{"bytes": png, "path": None}], "ability": "vision",
                 "reward_model": {"style": "rule", "ground_truth": colour},
                 "extra_info": {"split": split, "index": i, "colour": colour, **geo}} for i, (colour, geo, png) in enumerate(drawn)]

    train = samples("train", n_train, seed * 2 + 1)
    val = samples("val", n_val, seed * 2 + 2)
    rng = random.Random(seed)
    sft_rows = [{"prompt": prompt, "images": [{"bytes": png, "path": None}],
                 "response": wrong_colour(colour) if rng.random() < bias_prob else colour}
                for colour, _geo, png in train for _ in range(sft_copies)]
    rng.shuffle(sft_rows)
    return {
        "train": write_parquet(rl_rows("train", train), out / "train.parquet"),
        "val": write_parquet(rl_rows("val", val), out / "val.parquet"),
        "sft": write_parquet(sft_rows, out / "sft.parquet"),
    }


def make_vision_render_task(out_dir, n_train: int = 64, n_val: int = 16, size: int = 56, seed: int = 0) -> dict[str, pathlib.Path]:
    """Write the ``vision_render`` task: ``train.parquet`` / ``val.parquet`` (verl's multimodal rows: the grey circle in
    ``images``, the circle in ``extra_info.tools_kwargs.render.create_kwargs``) and ``tool_config.yaml`` (the render tool)."""
    import json

    out = pathlib.Path(out_dir)

    def rows(split: str, n: int, split_seed: int) -> list[dict]:
        rng = random.Random(split_seed)
        drawn = [_draw_sample(rng, size) for _ in range(n)]
        return [{"data_source": VISION_DATA_SOURCE, "prompt": [{"role": "user", "content": RENDER_QUESTION}],
                 "images": [{"bytes": png_bytes(draw_circle(colour, geo["cx"], geo["cy"], geo["r"], size, fill=HIDDEN)), "path": None}],
                 "ability": "vision", "reward_model": {"style": "rule", "ground_truth": colour},
                 "extra_info": {"split": split, "index": i, "tools_kwargs": {"render": {"create_kwargs": {"colour": colour, **geo, "size": size}}}}}
                for i, (colour, geo, _img) in enumerate(drawn)]

    tool_config = out / "tool_config.yaml"
    out.mkdir(parents=True, exist_ok=True)
    tool_config.write_text(json.dumps({"tools": [{"class_name": "render", "config": {"type": "native"}}]}))  # JSON is YAML
    return {"train": write_parquet(rows("train", n_train, seed * 2 + 1), out / "train.parquet"),
            "val": write_parquet(rows("val", n_val, seed * 2 + 2), out / "val.parquet"), "tool_config": tool_config}
