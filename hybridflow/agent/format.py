"""Tool-call formats (how a model writes a call, how a result goes back) and chat-template deltas.

Two jobs live here because both are about text the chat template owns:

1. A *format* (registered by name; config ``format: hermes``) parses the model's decoded text for
   tool calls and turns a ``ToolResult`` into the message the template renders next. ``hermes``
   is the Hermes / Qwen2.5 convention::

       <tool_call>
       {"name": "calculator", "arguments": {"expression": "2+3"}}
       </tool_call>

2. Token ids for what the loop appends after the model's turn. The rule (design.md): never decode
   and re-encode the model's own tokens. So the loop keeps the model's ids as generated and
   appends only the *delta* of the next message, computed on a fixed dummy conversation as
   ``template(base + [msg]) - template(base)`` (verl's way). See ``message_delta_ids`` for the one
   token a template may put between the model's stop token and the end of its turn.

Tool schemas reach the prompt through ``apply_chat_template(..., tools=schemas)`` when the
template knows tools (Qwen2.5, Llama 3.1, Hermes models); when it ignores them — as the repo's
tiny test template does — the format's own tool description is put into the system message
(``apply_chat_template_with_tools`` decides by rendering with and without a probe tool).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from hybridflow.agent.images import ImageError, has_images, render_with_images, split_images
from hybridflow.agent.registry import class_registry
from hybridflow.agent.tools import ToolCall, ToolResult
from hybridflow.data.chat import chat_ids

__all__ = [
    "ChatTemplateError",
    "HermesFormat",
    "ParsedResponse",
    "ToolCallFormat",
    "apply_chat_template_with_tools",
    "get_format",
    "message_delta_ids",
    "message_delta_inputs",
    "prompt_inputs",
    "register_format",
    "template_supports_tools",
    "turn_end_ids",
]


class ChatTemplateError(ValueError):
    """The chat template cannot give what the agent loop needs (e.g. it is not append-only)."""


@dataclass
class ParsedResponse:
    """The model's turn split into plain text, the tool calls it asked for, and what failed to parse.

    ``errors`` holds one readable line per malformed call (bad JSON, missing name, unclosed tag);
    the loop may show them to the model as a tool error so it learns the format.
    """

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class ToolCallFormat:
    """Base class of a tool-call format; subclasses implement ``parse`` and ``system_prompt``."""

    name: str = ""

    def parse(self, text: str) -> ParsedResponse:
        raise NotImplementedError

    def system_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """The tool description for templates that ignore ``tools=`` (goes into the system message)."""
        raise NotImplementedError

    def render_calls(self, content: str, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        """An assistant turn's text with its tool calls (name, arguments) written as the model writes them."""
        raise NotImplementedError

    def tool_message(self, result: ToolResult | str, name: str | None = None) -> dict[str, Any]:
        """The chat message that carries a tool's answer (the template decides how it looks): its text, or with the
        result's images a content list, the images first (``{"type": "image", "image": ...}``) and then the text."""
        text = result.text if isinstance(result, ToolResult) else str(result)
        images = result.images if isinstance(result, ToolResult) else []
        content: Any = [*({"type": "image", "image": im} for im in images), {"type": "text", "text": text}] if images else text
        msg: dict[str, Any] = {"role": "tool", "content": content}
        if name is not None:
            msg["name"] = name
        return msg


_FORMATS: dict[str, type[ToolCallFormat]] = {}


register_format = class_registry("tool-call format", _FORMATS, set_name=True)


def get_format(name: str | ToolCallFormat) -> ToolCallFormat:
    if isinstance(name, ToolCallFormat):
        return name
    if name not in _FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(_FORMATS)}")
    return _FORMATS[name]()


@register_format("hermes")
class HermesFormat(ToolCallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedResponse:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for i, m in enumerate(self._BLOCK.finditer(text)):
            call, err = self._decode(m.group(1))
            if call is not None:
                calls.append(call)
            else:
                errors.append(f"tool call {i}: {err}")
        rest = self._BLOCK.sub("", text)
        if self.OPEN in rest:  # an opened block that never closed: usually a turn cut by max_tokens
            errors.append(f"tool call {len(calls) + len(errors)}: {self.OPEN} without {self.CLOSE}")
            rest = rest[: rest.index(self.OPEN)]
        return ParsedResponse(content=rest.strip(), calls=calls, errors=errors)

    @staticmethod
    def _decode(body: str) -> tuple[ToolCall | None, str]:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            return None, f"invalid JSON ({e.msg} at char {e.pos})"
        if not isinstance(obj, dict):
            return None, f"expected a JSON object, got {type(obj).__name__}"
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return None, "missing string 'name'"
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                return None, f"'arguments' of {name!r} is a string that is not JSON ({e.msg})"
        if not isinstance(args, dict):
            return None, f"'arguments' of {name!r} must be a JSON object"
        return ToolCall(name, args), ""

    def render_calls(self, content: str, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        blocks = [f"{self.OPEN}\n{json.dumps({'name': n, 'arguments': dict(a)}, ensure_ascii=False)}\n{self.CLOSE}" for n, a in calls]
        return "\n".join([content.strip()] * bool(content.strip()) + blocks)

    def system_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        lines = "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\n"
            "You can call functions to help answer. Their signatures are inside <tools></tools>:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments inside "
            "<tool_call></tool_call> tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )


# ------------------------------------------------------------------------------------ templates
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_tool_x", "description": "probe", "parameters": {"type": "object", "properties": {}}},
}


def template_supports_tools(tokenizer) -> bool:
    """Does the chat template render ``tools=``? (renders a probe with and without a tool; compares)."""
    msgs = [{"role": "user", "content": "hi"}]
    try:
        with_tool = tokenizer.apply_chat_template(msgs, tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that chokes on tools does not support them
        return False
    return with_tool != tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def apply_chat_template_with_tools(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    fmt: str | ToolCallFormat = "hermes",
    add_generation_prompt: bool = True,
    tokenize: bool = True,
    **kwargs: Any,
) -> list[int] | str:
    """The first prompt of an agent trajectory, with the tool schemas in it.

    Templates that know tools get ``tools=`` (their own wording, which the model was trained on).
    Otherwise the ``system_prompt`` of format ``fmt`` is added to the system message (a new one
    first when the conversation has none) — the fallback the repo's tiny Qwen-style template needs.
    """
    messages = [dict(m) for m in messages]
    if tools:
        if template_supports_tools(tokenizer):
            kwargs["tools"] = [dict(t) for t in tools]
        else:
            desc = get_format(fmt).system_prompt(tools)
            if messages and messages[0].get("role") == "system":
                messages[0]["content"] = f"{messages[0]['content']}\n\n{desc}"
            else:
                messages.insert(0, {"role": "system", "content": desc})
    if tokenize:
        return chat_ids(tokenizer, messages, add_generation_prompt, **kwargs)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)


# Fixed dummy conversation the deltas are measured against: it ends with a complete assistant turn,
# which is where the agent loop stands when it appends a tool or environment message.
DELTA_BASE: tuple[dict[str, str], ...] = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"})


def message_delta_ids(
    tokenizer,
    message: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    after_eos: bool = False,
    stop_ids: Sequence[int] | None = None,
    **kwargs: Any,
) -> list[int]:
    """Token ids that appending ``message`` (or several, e.g. parallel tool results) adds after an assistant turn.

    ``template(DELTA_BASE + msgs, add_generation_prompt) - template(DELTA_BASE)``; with
    ``add_generation_prompt`` the next assistant header is included, so the ids end where the model
    continues. Several messages are rendered together because templates may group them (Qwen2.5
    puts consecutive tool results in one user turn), so their delta is not the concatenation.

    Identity (tested for a Qwen- and a Llama-3-style template): for a conversation ``conv``,

        template(conv + [asst], gen=False) + delta(msg) == template(conv + [asst, msg], gen=True)

    where ``asst`` is rendered by the template. The model's own tokens are not quite that: they end
    at the stop token (eos), and some templates write more after it (Qwen's ``<|im_end|>`` is
    followed by ``"\\n"``; Llama-3's ``<|eot_id|>`` by nothing). ``after_eos=True`` prepends those
    tokens (``turn_end_ids``; ``stop_ids`` as there), so that ``prompt_ids + model ids ending in eos + delta`` equals the
    template's rendering of the whole conversation. verl appends without them; both are
    self-consistent, ``after_eos=True`` matches what the model sees when served through its template.
    """
    msgs = [dict(message)] if isinstance(message, Mapping) else [dict(m) for m in message]
    base = chat_ids(tokenizer, DELTA_BASE, False, **kwargs)
    full = chat_ids(tokenizer, [*DELTA_BASE, *msgs], add_generation_prompt, **kwargs)
    if full[: len(base)] != base:
        raise ChatTemplateError(
            "the chat template is not append-only: rendering the conversation plus "
            f"{[m.get('role') for m in msgs]} does not start with the rendering of the conversation alone, "
            "so the ids of a new message cannot be appended to the model's tokens"
        )
    delta = full[len(base):]
    return (turn_end_ids(tokenizer, stop_ids, **kwargs) + delta) if after_eos else delta


def turn_end_ids(tokenizer, stop_ids: Sequence[int] | None = None, **kwargs: Any) -> list[int]:
    """Tokens the template writes after the stop token that closes an assistant turn.

    Qwen-style: ``[id("\\n")]`` (after ``<|im_end|>``); Llama-3-style: ``[]`` (after ``<|eot_id|>``).
    ``stop_ids`` are the ids generation stops at (default: the tokenizer's eos).
    """
    stops = set(stop_ids) if stop_ids is not None else {tokenizer.eos_token_id}
    prompt = chat_ids(tokenizer, DELTA_BASE[:1], True, **kwargs)
    turn = chat_ids(tokenizer, DELTA_BASE, False, **kwargs)
    if turn[: len(prompt)] != prompt:
        raise ChatTemplateError("the chat template renders an assistant turn that does not extend its generation prompt")
    assistant = turn[len(prompt):]  # shape: content ids + end-of-turn ids
    for i, t in enumerate(assistant):
        if t in stops:
            return assistant[i + 1:]
    raise ChatTemplateError(
        f"the chat template never writes a stop token {sorted(stops)} after an assistant message; "
        "pass stop_ids= with the token(s) generation stops at"
    )



def prompt_inputs(tokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, fmt: str | ToolCallFormat = "hermes",
                  processor: Any = None) -> tuple[list[int], dict]:
    """`apply_chat_template_with_tools` (tokenized) for messages that may carry image parts (`agent/images.py`): (ids, the
    images' pixel inputs {"pixel_values": [P, D], "image_grid_thw": [n, 3]}, {} without images). With a processor (a VLM)
    the rendered text always goes through it, so a text that spells the image token is refused, not fed without pixels.
    ImageError: an image for a text-only model (processor None), an image that cannot be decoded, a stray image token."""
    if processor is None:
        if has_images(messages):
            raise ImageError("this model is text-only (it has no image processor), so a message cannot carry an image")
        return list(apply_chat_template_with_tools(tokenizer, messages, tools, fmt)), {}
    rendered, images = split_images(messages)
    return render_with_images(processor, apply_chat_template_with_tools(tokenizer, rendered, tools, fmt, tokenize=False), images)


def message_delta_inputs(
    tokenizer,
    message: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    processor: Any = None,
    add_generation_prompt: bool = True,
    *,
    after_eos: bool = False,
    stop_ids: Sequence[int] | None = None,
) -> tuple[list[int], dict]:
    """`message_delta_ids` for messages that may carry image parts: (delta ids, their images' pixel inputs; {} without images).

    With a processor (a VLM) the delta is measured as the text's is, through the processor: ``processor(template(base +
    msgs)) - processor(template(base))``, so each image's ``<|image_pad|>`` run has the length the processor gives it in the
    whole conversation (grid_t * grid_h * grid_w / merge_size**2) and its pixel inputs are the processor's for that image.
    ImageError as in `prompt_inputs`."""
    msgs = [dict(message)] if isinstance(message, Mapping) else [dict(m) for m in message]
    if processor is None:
        if has_images(msgs):
            raise ImageError("this model is text-only (it has no image processor), so a message cannot carry an image")
        return message_delta_ids(tokenizer, msgs, add_generation_prompt, after_eos=after_eos, stop_ids=stop_ids), {}
    rendered, images = split_images(msgs)
    base, _ = render_with_images(processor, tokenizer.apply_chat_template(list(DELTA_BASE), add_generation_prompt=False, tokenize=False), [])
    full_text = tokenizer.apply_chat_template([*DELTA_BASE, *rendered], add_generation_prompt=add_generation_prompt, tokenize=False)
    full, mm = render_with_images(processor, full_text, images)
    if full[: len(base)] != base:
        raise ChatTemplateError("the chat template is not append-only through the processor: the rendering with "
                                f"{[m.get('role') for m in msgs]} does not start with the rendering of the conversation alone")
    delta = full[len(base):]
    return (turn_end_ids(tokenizer, stop_ids) + delta) if after_eos else delta, mm
