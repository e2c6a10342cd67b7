"""A chat template applied as token ids: one function for the dataset and the agent loop (no torch)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def chat_ids(tokenizer, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
    """``apply_chat_template(..., tokenize=True)`` as a plain list of ids (transformers v4 and v5
    shapes); kwargs go to the template (e.g. ``tools=``)."""
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
    if hasattr(out, "keys"):  # v5 returns a BatchEncoding
        out = out["input_ids"]
    if hasattr(out, "tolist"):  # a tensor
        out = out.tolist()
    out = list(out)
    if out and isinstance(out[0], (list, tuple)):  # batched form [[...]]
        out = list(out[0])
    return [int(x) for x in out]
