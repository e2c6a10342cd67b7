"""Parquet datasets for RL (prompts) and SFT (prompt + response), verl schema.

Every row is validated up front, so a bad file fails at start-up with the file path and row number
(0-based, as pandas / pyarrow number rows) instead of deep inside a training step.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.utils.data import Dataset

from hybridflow.data.chat import chat_ids
from hybridflow.protocol import Batch

logger = logging.getLogger(__name__)

RL_REQUIRED = "each row needs data_source, prompt, reward_model.ground_truth"
SFT_REQUIRED = "each row needs prompt, response"
TRUNCATION_MODES = ("left", "right", "error")


class DataError(ValueError):
    """A data file is missing, unreadable, or holds a malformed row."""


# --------------------------------------------------------------------------------------------- io
def load_rows(files) -> list[tuple[str, int, dict]]:
    """Read parquet files -> ``[(file, row_number, row_dict), ...]`` with plain Python values."""
    import pyarrow.parquet as pq

    if isinstance(files, (str, os.PathLike)):
        files = [files]
    files = [str(f) for f in files]
    if not files:
        raise DataError("no data files given")
    rows: list[tuple[str, int, dict]] = []
    for f in files:
        if not os.path.isfile(f):
            raise DataError(f"data file not found: {f}")
        try:
            table = pq.read_table(f)
        except Exception as e:  # noqa: BLE001 - re-raised with the file name
            raise DataError(f"cannot read parquet file {f}: {e}") from e
        for i, row in enumerate(table.to_pylist()):
            rows.append((f, i, row))
    return rows


def _names(files) -> list[str]:
    return [str(files)] if isinstance(files, (str, os.PathLike)) else [str(f) for f in files]


def text_ids(tokenizer, text: str) -> list[int]:
    out = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(x) for x in out]


# ------------------------------------------------------------------------------------ validation
def _check_chat(file: str, row_no: int, row: dict, key: str, required: str) -> list[dict]:
    value = row.get(key)
    if value is None:
        raise DataError(f"{file} row {row_no}: column {key!r} is missing or null ({required})")
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{file} row {row_no}: column {key!r} must be a non-empty chat list of "
            f"{{role, content}} messages, got {type(value).__name__} {value!r:.80}"
        )
    for j, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise DataError(
                f"{file} row {row_no}: column {key!r} message {j} must be a dict with string 'role' and "
                f"'content', got {msg!r:.80}"
            )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _validate_rl_row(file: str, row_no: int, row: dict, prompt_key: str) -> dict:
    for col in ("data_source", prompt_key, "reward_model"):
        if row.get(col) is None:
            raise DataError(f"{file} row {row_no}: column {col!r} is missing or null ({RL_REQUIRED})")
    prompt = _check_chat(file, row_no, row, prompt_key, RL_REQUIRED)
    rm = row["reward_model"]
    if not isinstance(rm, dict):
        raise DataError(
            f"{file} row {row_no}: column 'reward_model' must be a dict with 'ground_truth', "
            f"got {type(rm).__name__} ({RL_REQUIRED})"
        )
    if rm.get("ground_truth") is None:
        raise DataError(f"{file} row {row_no}: 'reward_model.ground_truth' is missing or null ({RL_REQUIRED})")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DataError(f"{file} row {row_no}: column 'extra_info' must be a dict or null, got {type(extra).__name__}")
    return {
        "data_source": str(row["data_source"]),
        "prompt": prompt,
        "reward_model": dict(rm),
        "extra_info": dict(extra) if extra else {},
    }


# ------------------------------------------------------------------------------------------- RL
class RLDataset(Dataset):
    """Prompt dataset for rollouts.

    Over-long prompts (> ``max_prompt_length`` tokens after the chat template): with
    ``filter_overlong_prompts`` they are dropped (count in ``num_filtered``); otherwise
    ``truncation`` decides: "left" keeps the last tokens, "right" the first, "error" raises.
    """

    def __init__(
        self,
        files,
        tokenizer,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
    ):
        if truncation not in TRUNCATION_MODES:
            raise DataError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if max_prompt_length <= 0:
            raise DataError(f"data.max_prompt_length must be > 0, got {max_prompt_length}")
        self.tokenizer = tokenizer
        self.max_prompt_length = int(max_prompt_length)
        self.prompt_key = prompt_key
        self.num_filtered = 0
        self.num_truncated = 0
        self.items: list[dict[str, Any]] = []
        rows = load_rows(files)
        for file, row_no, row in rows:
            rec = _validate_rl_row(file, row_no, row, prompt_key)
            extra_fields = self.encode_prompt(file, row_no, row, rec)  # {"input_ids": [...], ...more per-sample fields}
            ids = extra_fields.pop("input_ids")
            if len(ids) > self.max_prompt_length:
                if filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if truncation == "error":
                    raise DataError(
                        f"{file} row {row_no}: prompt is {len(ids)} tokens, longer than "
                        f"data.max_prompt_length={self.max_prompt_length}; raise data.max_prompt_length, "
                        f"set data.filter_overlong_prompts=true, or data.truncation=left|right"
                    )
                ids = ids[-self.max_prompt_length :] if truncation == "left" else ids[: self.max_prompt_length]
                self.num_truncated += 1
            self.items.append(
                {
                    "input_ids": ids,
                    "data_source": rec["data_source"],
                    "reward_model": rec["reward_model"],
                    "extra_info": rec["extra_info"],
                    "raw_prompt": rec["prompt"],
                    "index": len(self.items),
                    **extra_fields,
                }
            )
        if self.num_filtered:
            logger.warning(
                "RLDataset: dropped %d of %d prompts longer than data.max_prompt_length=%d",
                self.num_filtered,
                len(rows),
                self.max_prompt_length,
            )
        if not self.items:
            raise DataError(
                f"RLDataset: no usable prompts in {_names(files)}"
                + (" (the files hold no rows)" if not rows else
                   f" ({self.num_filtered} filtered as longer than data.max_prompt_length={self.max_prompt_length})")
            )

    def encode_prompt(self, file: str, row_no: int, row: dict, rec: dict) -> dict[str, Any]:
        """One validated row -> ``{"input_ids": prompt ids}`` (plus any per-sample fields a subclass adds:
        the image inputs of `data/vision.py::VisionRLDataset`). A text model refuses a row with images."""
        if row.get("images"):
            raise DataError(
                f"{file} row {row_no}: the row has {len(row['images'])} image(s) but this prompt dataset is text-only (a text model's "
                f"tokenizer; images need a vision-language model's processor: hybridflow/data/vision.py) - drop the 'images' column "
                f"or use a VLM (hybridflow make-model --arch qwen2_vl)"
            )
        return {"input_ids": chat_ids(self.tokenizer, rec["prompt"], add_generation_prompt=True)}

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self.items[i]
        return {**item, "input_ids": list(item["input_ids"])}


def collate_rl(items: list[dict], pad_token_id: int, max_prompt_length: int, padding: str = "max_length") -> Batch:
    """Left-pad prompts to ``max_prompt_length`` (padding "longest": to the batch's longest prompt)
    -> Batch(input_ids, attention_mask, position_ids, ...)."""
    bsz = len(items)
    for item in items:
        if len(item["input_ids"]) > max_prompt_length:
            raise DataError(f"prompt of {len(item['input_ids'])} tokens exceeds data.max_prompt_length={max_prompt_length}")
    width = max_prompt_length if padding == "max_length" else max([1, *(len(it["input_ids"]) for it in items)])
    input_ids = torch.full((bsz, width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((bsz, width), dtype=torch.long)
    for r, item in enumerate(items):
        ids = item["input_ids"]
        n = len(ids)
        if n:
            input_ids[r, width - n :] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[r, width - n :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return Batch.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        non_tensors={
            "data_source": [it["data_source"] for it in items],
            "reward_model": [it["reward_model"] for it in items],
            "extra_info": [it.get("extra_info") or {} for it in items],
            "raw_prompt": [it["raw_prompt"] for it in items],
            "index": [int(it["index"]) for it in items],
        },
    )


# ------------------------------------------------------------------------------------------ SFT
class SFTDataset(Dataset):
    """Prompt/response pairs for SFT.

    ids = chat_template(prompt, add_generation_prompt=True) + response tokens + [eos]. Sequences
    longer than ``max_length`` are truncated on the RIGHT (the end of the response, and possibly
    its eos, is cut; counted in ``num_truncated``). A prompt that leaves no room for any response
    token raises DataError. Items are right-padded to ``max_length``; ``loss_mask`` is 1 exactly on
    the response tokens (eos included) that survive truncation. Subclasses (multi-turn
    conversations: ``hybridflow/agent/sft_data.py``) override ``encode_row``.
    """

    def __init__(self, files, tokenizer, max_length: int, prompt_key: str = "prompt", response_key: str = "response"):
        if max_length <= 1:
            raise DataError(f"data.max_length must be > 1, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.prompt_key, self.response_key = prompt_key, response_key
        eos = tokenizer.eos_token_id
        if eos is None:
            raise DataError("tokenizer has no eos_token_id; SFT needs one to end responses")
        self.eos_token_id = int(eos)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else eos)
        self.num_truncated = 0
        self.samples: list[tuple[list[int], list[int]]] = []  # (ids, loss mask), unpadded
        for file, row_no, row in load_rows(files):
            ids, mask = self.encode_row(file, row_no, row)
            first = mask.index(1) if 1 in mask else len(mask)
            if first >= self.max_length:
                raise DataError(
                    f"{file} row {row_no}: prompt is {first} tokens, leaving no room for the response "
                    f"within data.max_length={self.max_length}; raise data.max_length"
                )
            if len(ids) > self.max_length:
                ids, mask = ids[: self.max_length], mask[: self.max_length]
                self.num_truncated += 1
            self.samples.append((ids, mask))
        if self.num_truncated:
            logger.warning(
                "SFTDataset: truncated %d sequences on the right to data.max_length=%d",
                self.num_truncated,
                self.max_length,
            )

    def encode_row(self, file: str, row_no: int, row: dict) -> tuple[list[int], list[int]]:
        """One row -> (token ids, loss mask: 1 on the tokens the model learns to write)."""
        prompt = _check_chat(file, row_no, row, self.prompt_key, SFT_REQUIRED)
        response = row.get(self.response_key)
        if response is None:
            raise DataError(f"{file} row {row_no}: column {self.response_key!r} is missing or null ({SFT_REQUIRED})")
        if not isinstance(response, str):
            raise DataError(
                f"{file} row {row_no}: column {self.response_key!r} must be a string, got {type(response).__name__}"
            )
        p_ids = chat_ids(self.tokenizer, prompt, add_generation_prompt=True)
        r_ids = text_ids(self.tokenizer, response) + [self.eos_token_id]
        return p_ids + r_ids, [0] * len(p_ids) + [1] * len(r_ids)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, mask = self.samples[i]
        n = len(ids)
        L = self.max_length
        input_ids = torch.full((L,), self.pad_token_id, dtype=torch.long)
        input_ids[:n] = torch.as_tensor(ids, dtype=torch.long)
        attention_mask = torch.zeros(L, dtype=torch.long)
        attention_mask[:n] = 1
        loss_mask = torch.zeros(L, dtype=torch.long)
        loss_mask[:n] = torch.as_tensor(mask, dtype=torch.long)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "loss_mask": loss_mask,
        }


def collate_sft(items: list[dict]) -> Batch:
    keys = items[0].keys()
    return Batch.from_dict(tensors={k: torch.stack([it[k] for it in items]) for k in keys})
