"""Multi-turn SFT rows tokenized exactly as the agent loop builds a trajectory.

A row is a conversation (``messages``: system / user first, then assistant turns with tool or user
messages between them) plus the tool schemas (``tools``: a list, or its JSON string — verl's
``data.multiturn.{messages_key, tools_key}``). The ids are built the way ``loop.py`` builds them at
rollout time, so SFT teaches the very token sequence RL later samples and extends:

    prompt      apply_chat_template_with_tools(messages before the first assistant turn, tools)
    assistant   its content's tokens + eos                      loss 1 (the model writes these)
    others      message_delta_ids(run of non-assistant messages, after_eos=True)   loss 0

(rendering the whole conversation at once could differ by template whitespace; this cannot).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from hybridflow.agent.format import apply_chat_template_with_tools, message_delta_ids
from hybridflow.data.dataset import DataError, SFTDataset, _check_chat, text_ids

MULTITURN_REQUIRED = "each row needs messages (a chat list with at least one assistant turn after the first user message)"


class MultiTurnSFTDataset(SFTDataset):
    """`SFTDataset` over conversations; loss on every assistant turn (its eos included)."""

    def __init__(self, files, tokenizer, max_length: int, messages_key: str = "messages", tools_key: str = "tools", fmt: str = "hermes"):
        self.messages_key, self.tools_key, self.fmt = messages_key, tools_key, fmt
        super().__init__(files, tokenizer, max_length)

    def encode_row(self, file: str, row_no: int, row: dict) -> tuple[list[int], list[int]]:
        messages = _check_chat(file, row_no, row, self.messages_key, MULTITURN_REQUIRED)
        roles = [m["role"] for m in messages]
        if "assistant" not in roles or roles.index("assistant") == 0:
            raise DataError(f"{file} row {row_no}: column {self.messages_key!r} has roles {roles} ({MULTITURN_REQUIRED})")
        tools = self._tools(file, row_no, row.get(self.tools_key))
        first = roles.index("assistant")
        ids = list(apply_chat_template_with_tools(self.tokenizer, messages[:first], tools, self.fmt))
        mask = [0] * len(ids)
        runs = [(assistant, list(run)) for assistant, run in itertools.groupby(messages[first:], key=lambda m: m["role"] == "assistant")]
        for k, (assistant, run) in enumerate(runs):
            if assistant:  # each turn ends with its own eos
                pieces = [text_ids(self.tokenizer, m["content"]) + [self.eos_token_id] for m in run]
            else:  # one delta for the run; after the last assistant turn no generation prompt (nothing follows)
                pieces = [message_delta_ids(self.tokenizer, run, add_generation_prompt=k < len(runs) - 1, after_eos=True)]
            for piece in pieces:
                ids += piece
                mask += [int(assistant)] * len(piece)
        return ids, mask

    def _tools(self, file: str, row_no: int, value: Any) -> list[dict] | None:
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise DataError(f"{file} row {row_no}: column {self.tools_key!r} is a string that is not JSON ({e.msg})") from e
        if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
            raise DataError(f"{file} row {row_no}: column {self.tools_key!r} must be a list of OpenAI function schemas, got {value!r:.80}")
        return value
