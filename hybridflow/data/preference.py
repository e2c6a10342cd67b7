"""Preference data (prompt, chosen, rejected) for DPO and reward-model training.

Rows (parquet): `prompt` (chat list), `chosen` and `rejected` (a string, or a chat list of
assistant messages whose contents are joined), optional `data_source` / `extra_info`. Every row is
validated up front; a bad row fails at start-up naming file and row (0-based).

A pair batch holds 2P rows, chosen and rejected interleaved ([c0, r0, c1, r1, ...]) so that one
forward scores both sides and any even split keeps pairs whole. The sequence layout is the RL
one (`engine/model.py`): input_ids [2P, Lp+R] = left-padded prompt + right-padded response
(response tokens + eos), responses / response_mask [2P, R]; `pair_weight` [2P] is 1.0 for a pair
that counts (online DPO zeroes pairs whose samples tie); `margin` [2P] is the optional per-pair
Bradley-Terry margin column (0 when absent).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import Dataset

from hybridflow.data.chat import chat_ids
from hybridflow.data.dataset import DataError, _check_chat, _names, load_rows, text_ids
from hybridflow.protocol import Batch

logger = logging.getLogger(__name__)

PREF_REQUIRED = "each row needs prompt, chosen, rejected"


def _response_text(file: str, row_no: int, row: dict, key: str) -> str:
    """`chosen` / `rejected`: a string, or assistant chat messages (their contents, joined)."""
    value = row.get(key)
    if value is None:
        raise DataError(f"{file} row {row_no}: column {key!r} is missing or null ({PREF_REQUIRED})")
    if isinstance(value, str):
        return value
    messages = _check_chat(file, row_no, row, key, PREF_REQUIRED)
    roles = {m["role"] for m in messages}
    if roles != {"assistant"}:
        raise DataError(f"{file} row {row_no}: column {key!r} as a chat list must hold assistant messages only, got roles {sorted(roles)}")
    return "".join(m["content"] for m in messages)


def response_ids(tokenizer, text: str) -> list[int]:
    """A response as the policy produces it: its tokens then eos."""
    return text_ids(tokenizer, text) + [int(tokenizer.eos_token_id)]


def pack_sequences(prompts: list[list[int]], responses: list[list[int]], pad_token_id: int, prompt_len: int, response_len: int) -> dict[str, torch.Tensor]:
    """Token lists -> the RL layout: input_ids/attention_mask/position_ids [B, Lp+R] (prompt
    left-padded to Lp, response right-padded to R), responses/response_mask [B, R]."""
    bsz = len(prompts)
    prompt_ids = torch.full((bsz, prompt_len), pad_token_id, dtype=torch.long)
    resp = torch.full((bsz, response_len), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((bsz, prompt_len), dtype=torch.long)
    resp_mask = torch.zeros((bsz, response_len), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        p, r = p[-prompt_len:], r[:response_len]  # callers validate lengths; this only guards shapes
        if p:
            prompt_ids[i, prompt_len - len(p):] = torch.as_tensor(p)
            prompt_mask[i, prompt_len - len(p):] = 1
        if r:
            resp[i, : len(r)] = torch.as_tensor(r)
            resp_mask[i, : len(r)] = 1
    attention_mask = torch.cat([prompt_mask, resp_mask], dim=1)
    return {
        "input_ids": torch.cat([prompt_ids, resp], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": resp,
        "response_mask": resp_mask,
    }


class PreferenceDataset(Dataset):
    """(prompt, chosen, rejected) rows, tokenized: a prompt longer than `max_prompt_length` is an
    error naming file and row (preference pairs are curated: silently dropping one hides a bug); a
    response longer than `max_response_length` (eos included) is cut on the right and counted."""

    def __init__(self, files, tokenizer, max_prompt_length: int, max_response_length: int,
                 prompt_key: str = "prompt", chosen_key: str = "chosen", rejected_key: str = "rejected"):
        if tokenizer.eos_token_id is None:
            raise DataError("tokenizer has no eos_token_id; preference responses end with one")
        self.max_prompt_length, self.max_response_length = int(max_prompt_length), int(max_response_length)
        self.num_truncated = 0
        self.num_filtered = 0  # (an over-long prompt is an error here, never dropped)
        self.items: list[dict[str, Any]] = []
        for file, row_no, row in load_rows(files):
            prompt = _check_chat(file, row_no, row, prompt_key, PREF_REQUIRED)
            chosen = _response_text(file, row_no, row, chosen_key)
            rejected = _response_text(file, row_no, row, rejected_key)
            p_ids = chat_ids(tokenizer, prompt, add_generation_prompt=True)
            if len(p_ids) > self.max_prompt_length:
                raise DataError(f"{file} row {row_no}: prompt is {len(p_ids)} tokens, longer than "
                                f"data.max_prompt_length={self.max_prompt_length}; raise it")
            sides = []
            for text in (chosen, rejected):
                ids = response_ids(tokenizer, text)
                if len(ids) > self.max_response_length:
                    ids = ids[: self.max_response_length]
                    self.num_truncated += 1
                sides.append(ids)
            extra = row.get("extra_info")
            margin = row.get("margin", 0.0)
            if margin is None or isinstance(margin, bool) or not isinstance(margin, (int, float)):
                raise DataError(f"{file} row {row_no}: column 'margin' must be a number, got {margin!r:.40}")
            self.items.append({"prompt_ids": p_ids, "chosen_ids": sides[0], "rejected_ids": sides[1], "raw_prompt": prompt, "margin": float(margin),
                               "chosen": chosen, "rejected": rejected, "data_source": str(row.get("data_source") or "preference"),
                               "extra_info": dict(extra) if isinstance(extra, dict) else {}, "index": len(self.items)})
        if self.num_truncated:
            logger.warning("PreferenceDataset: cut %d responses to data.max_response_length=%d", self.num_truncated, self.max_response_length)
        if not self.items:
            raise DataError(f"PreferenceDataset: the files hold no rows: {_names(files)}")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def collate_pairs(items: list[dict], pad_token_id: int, max_prompt_length: int, max_response_length: int) -> Batch:
    """P preference items -> a pair batch of 2P rows, chosen and rejected interleaved."""
    prompts = [it["prompt_ids"] for it in items for _ in range(2)]
    responses = [ids for it in items for ids in (it["chosen_ids"], it["rejected_ids"])]
    tensors = pack_sequences(prompts, responses, int(pad_token_id), max_prompt_length, max_response_length)
    tensors["pair_weight"] = torch.ones(len(responses))
    tensors["margin"] = torch.tensor([it["margin"] for it in items for _ in range(2)])  # reward-model training's per-pair margin
    twice = lambda key: [it[key] for it in items for _ in range(2)]  # noqa: E731
    return Batch.from_dict(tensors=tensors, non_tensors={"raw_prompt": twice("raw_prompt"), "data_source": twice("data_source"),
                                                         "extra_info": twice("extra_info"), "index": twice("index")})
