"""Token-in/token-out sessions: what a black-box agent's requests become in training.

An agent written against an OpenAI-compatible URL sends whole conversations as *text* (its
history, our earlier replies included); the server must train on the *tokens* it fed and sampled.
Re-rendering a history re-tokenizes our replies, and that may give other ids than the ones sampled
(a different merge of the same text, a tool call written back in another JSON spelling): the
re-tokenization problem. So a `Session` records every reply it produced together with the
conversation it ends, and builds each next prompt from the recorded tokens:

    request i+1's messages = (a conversation we replied to, + our reply) + new messages
    prompt ids             = that conversation's recorded ids (prompt + sampled, exactly)
                             + the chat template's delta of the new messages (format.message_delta_ids)

and counts (`mismatches`) requests whose plain rendering differs from that: the recorded tokens win
and the difference is never trained on. A request that extends nothing recorded (the agent
rewrote, summarised or cut its history; a reply cut by max_tokens, which has no end of turn to
continue after) starts a new *segment*: a fresh trajectory from its own rendering. The session's
trajectory for training is its last segment (the one that ended the episode, which the reward
judges); earlier segments are counted (`dropped_segments`), not trained.

Shapes: a segment is an `agent.loop.Trajectory` (prompt ids, response ids with mask 1 on sampled
tokens and 0 on template / tool / user tokens, per-token log-probs and policy versions, and the pixel
inputs of the images its messages carried, `image_inputs`). With a VLM's processor, user and tool messages
may hold image parts (`agent/images.py`; the endpoint decodes them first): their tokens are the processor's
(mask 0), a message is identified by its text and its images' digests, and every request on the segment is
generated with all of its images so far.
No HTTP here: `openai_server.py` calls `plan`, `place` and `record`.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from hybridflow.agent.format import get_format, message_delta_inputs, prompt_inputs
from hybridflow.agent.images import ImageError, image_digest, is_image_part
from hybridflow.agent.loop import Trajectory
from hybridflow.protocol import Completion


def _text(content: Any) -> str:
    """OpenAI message content -> text: a string, None, or a list of parts ({type: text, text})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))


def _call_key(call: Mapping[str, Any]) -> tuple[str, str]:
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    try:
        args = json.dumps(json.loads(args) if isinstance(args, str) else args, sort_keys=True)
    except (TypeError, ValueError):
        args = str(args)
    return str(fn.get("name", "")), args


def _call_args(call: Mapping[str, Any]) -> dict:
    args = (call.get("function") or {}).get("arguments", "{}")
    return json.loads(args) if isinstance(args, str) else dict(args)


def message_key(m: Mapping[str, Any]) -> tuple:
    """What identifies a message when an agent sends our reply back: role, text, tool calls by name and
    decoded arguments (clients re-serialise the JSON and add fields such as refusal: null), and the digests
    of its images."""
    content = m.get("content")
    parts = content if isinstance(content, list) else ()
    images = tuple(p.get("digest") or image_digest(p.get("image", p.get("image_url"))) for p in parts if is_image_part(p))
    return (m.get("role"), _text(content).strip(), tuple(_call_key(c) for c in m.get("tool_calls") or ()), images)


def template_messages(messages: Sequence[Mapping[str, Any]], fmt: str) -> list[dict]:
    """OpenAI messages -> what the chat template renders: text content; an assistant's tool_calls
    written in the tool-call format's own syntax (how the model writes them); `developer` as system."""
    out = []
    for m in messages:
        role = "system" if m.get("role") == "developer" else m.get("role")
        text = _text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            # the arguments in the order the client sent them (ours: the order the model wrote them); _call_key's sorted
            # spelling is for comparing only, and re-rendering it would count every call with unsorted keys as a mismatch
            text = get_format(fmt).render_calls(text, [(n, _call_args(c)) for (n, _), c in zip(map(_call_key, m["tool_calls"]), m["tool_calls"])])
        content = m.get("content")
        if isinstance(content, list) and any(is_image_part(p) for p in content):  # text and image parts, in order
            msg = {"role": role, "content": [p if is_image_part(p) else {"type": "text", "text": str(p.get("text", ""))} for p in content]}
        else:
            msg = {"role": role, "content": text}
        if role == "tool" and m.get("name"):
            msg["name"] = m["name"]
        out.append(msg)
    return out


@dataclass
class _Point:
    """A conversation we replied to, our reply appended: where a next request may continue."""

    keys: tuple  # message_key of each message, our reply last
    segment: int  # which segment's tokens it ends
    length: int  # len(segment.response_ids) after the reply


@dataclass(frozen=True)
class Placement:
    """A request's prompt ids and where its reply would go (`Session.plan`); nothing recorded yet."""

    ids: list[int]
    left: int  # response tokens the segment may still take
    segment: int | None = None  # continued segment (None: a new one)
    length: int = 0  # its response tokens the prompt keeps
    delta: tuple[int, ...] | list[int] = ()  # the new messages' tokens (mask 0)
    mismatch: bool = False  # the plain rendering of the messages differs from `ids`
    images: dict = field(default_factory=dict)  # a new segment: its prompt's images' pixel inputs; else the new messages'


@dataclass
class Session:
    """One trajectory's requests: a black-box agent's episode. `key` is its own bearer token."""

    id: str
    tokenizer: Any
    fmt: str
    response_budget: int  # tokens of one segment's response (model + template), data.max_response_length
    max_prompt_tokens: int  # data.max_prompt_length: a new segment's prompt
    processor: Any = None  # a VLM's processor: messages may carry images (agent/images.py); None: text only
    key: str = field(default_factory=lambda: "hf-" + secrets.token_urlsafe(24))
    segments: list[Trajectory] = field(default_factory=list)
    points: list[_Point] = field(default_factory=list)
    requests: int = 0
    mismatches: int = 0  # requests whose plain rendering differs from the recorded tokens (the recorded ones were used)
    tool_calls: int = 0  # tool calls returned to the agent (first choices)
    sampling_overridden: int = 0  # requests that asked for another temperature / top_p than the run's (served with the run's)
    last: int = -1  # the segment the latest reply went to: the trained one
    closed: bool = False
    # segment -> the max new tokens of each request placed there whose reply is not recorded yet: the
    # segment's end belongs to those replies, and their tokens count against the session's token limit
    in_flight: dict[int, list[int]] = field(default_factory=dict)
    sampled: int = 0  # tokens the backend sampled for this session, over all its segments

    @property
    def requests_in_flight(self) -> int:
        return sum(len(v) for v in self.in_flight.values())

    @property
    def reserved(self) -> int:
        """Max new tokens of the requests in flight."""
        return sum(sum(v) for v in self.in_flight.values())

    def plan(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> "Placement":
        """Where a chat request goes, without changing the session (`place` commits it): continues the
        longest recorded conversation that `messages` extend, else a new segment. ValueError (a 400)
        when it does not fit the budgets."""
        keys = tuple(message_key(m) for m in messages)
        best = max((p for p in self.points if len(p.keys) < len(keys) and keys[: len(p.keys)] == p.keys), key=lambda p: len(p.keys), default=None)
        if best is None:
            return self._new(*prompt_inputs(self.tokenizer, template_messages(messages, self.fmt), tools, self.fmt, self.processor))
        seg = self.segments[best.segment]
        delta, images = message_delta_inputs(self.tokenizer, template_messages(messages[len(best.keys):], self.fmt), self.processor,
                                             add_generation_prompt=True, after_eos=True)
        ids = seg.prompt_ids + seg.response_ids[: best.length] + delta
        plain, _ = prompt_inputs(self.tokenizer, template_messages(messages, self.fmt), tools, self.fmt, self.processor)
        return self._continue(ids, best.segment, best.length, delta, mismatch=list(plain) != ids, images=images)

    def plan_ids(self, ids: Sequence[int]) -> "Placement":
        """/v1/completions: token ids (a tokenized text prompt). Continues the latest segment whose
        tokens it extends (the extension is mask 0), else a new segment."""
        ids = [int(t) for t in ids]
        for i in range(len(self.segments) - 1, -1, -1):
            seg = self.segments[i]
            have = seg.prompt_ids + seg.response_ids
            if len(ids) > len(have) and ids[: len(have)] == have and seg.response_ids:
                return self._continue(ids, i, len(seg.response_ids), _no_image_tokens(ids[len(have):], self.processor), mismatch=False)
        return self._new(_no_image_tokens(ids, self.processor))

    def _continue(self, ids: list[int], segment: int, length: int, delta: list[int], mismatch: bool, images: dict | None = None) -> "Placement":
        left = self.response_budget - length - len(delta)
        if left <= 0:
            raise ValueError(f"the conversation has used this trajectory's token budget ({self.response_budget} response tokens, "
                             f"data.max_response_length): {length + len(delta)} with the new messages")
        return Placement(ids, left, segment, length, delta, mismatch, images or {})

    def _new(self, ids: list[int], images: dict | None = None) -> "Placement":
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(f"the prompt is {len(ids)} tokens; this run's prompts take at most {self.max_prompt_tokens} "
                             f"(data.max_prompt_length)")
        return Placement(ids, self.response_budget, images=images or {})

    def place(self, p: "Placement", max_new_tokens: int = 0) -> int:
        """Commit a plan: the segment index its reply goes to, reserved until ``release``. A branch
        when the recorded point is not the segment's end (a retry, another of n choices) or when the
        segment awaits another request's reply: that reply goes right after its own prompt, and this
        request's prompt and reply go to a copy (requests in flight together never interleave)."""
        self.requests += 1
        self.mismatches += int(p.mismatch)
        if p.segment is None:
            self.segments.append(Trajectory(prompt_ids=p.ids, session=self.id, image_inputs=[(0, p.images)] if p.images else []))
            at = len(self.segments) - 1
        else:
            free = len(self.segments[p.segment].response_ids) == p.length and not self.in_flight.get(p.segment)
            at = p.segment if free else self.branch(p.segment, p.length)
            self.segments[at].append(p.delta, model=False, images=p.images)
        self.in_flight.setdefault(at, []).append(max_new_tokens)
        return at

    def release(self, segment: int) -> None:
        """The request placed in ``segment`` is done (its reply recorded, or it failed)."""
        held = self.in_flight.get(segment)
        if held:
            held.pop()
        if not held:
            self.in_flight.pop(segment, None)

    def branch(self, segment: int, length: int) -> int:
        """A new segment holding the first `length` response tokens of `segment`; its index."""
        self.segments.append(_truncated(self.segments[segment], length))
        return len(self.segments) - 1

    def record(self, segment: int, messages: Sequence[Mapping[str, Any]] | None, completion: Completion, reply: Mapping[str, Any] | None,
               stop_ids: Sequence[int]) -> None:
        """The reply `completion` to a request placed in `segment`: its tokens appended as sampled
        (mask 1, log-probs, versions); with chat messages, a point to continue from when the turn
        closed with a stop token (a reply cut by max_tokens or a stop string has no end of turn)."""
        if self.closed:  # a reply that arrived after its agent ended (timed out): the trajectory is already taken
            return
        seg = self.segments[segment]
        self.sampled += len(completion.token_ids)
        seg.append(completion.token_ids, model=True, log_probs=completion.log_probs,
                   untruncated_log_probs=completion.untruncated, versions=completion.versions)
        seg.num_turns += 1
        seg.finish = "answer" if completion.finish_reason == "stop" else "length"
        seg.finished_at = time.monotonic()
        self.last = segment
        if messages is not None and reply is not None and completion.token_ids and completion.token_ids[-1] in stop_ids:
            self.points.append(_Point(tuple(message_key(m) for m in [*messages, reply]), segment, len(seg.response_ids)))

    def trajectory(self) -> Trajectory | None:
        """The trained trajectory: the segment the latest reply went to (the agent's final episode);
        None when the agent made no request."""
        return self.segments[self.last] if self.last >= 0 else None

    @property
    def dropped_segments(self) -> int:
        return max(sum(1 for s in self.segments if s.num_turns) - 1, 0)


def _no_image_tokens(ids: list[int], processor: Any) -> list[int]:
    """`ids` (new prompt tokens of /v1/completions), refused (ImageError) when they hold a VLM's image token: a token ids
    prompt carries no pixels, and an image token without its pixels fails every forward over it."""
    pad = getattr(processor, "image_token_id", None)
    if pad is not None and pad in ids:
        raise ImageError(f"the prompt holds the image token (id {pad}); a token or text prompt carries no pixels: send images to "
                         f"/v1/chat/completions as image_url content parts")
    return ids


def _truncated(seg: Trajectory, n: int) -> Trajectory:
    """A new segment holding `seg`'s first n response tokens (a branch)."""
    out = Trajectory(prompt_ids=list(seg.prompt_ids), session=seg.session)
    out.response_ids, out.response_mask = seg.response_ids[:n], seg.response_mask[:n]
    out.log_probs, out.untruncated_log_probs, out.versions = seg.log_probs[:n], seg.untruncated_log_probs[:n], seg.versions[:n]
    out.num_turns = sum(1 for a, b in zip([0, *out.response_mask], out.response_mask) if b and not a)
    out.image_inputs = [(end, mm) for end, mm in seg.image_inputs if end <= n]  # a cut falls between messages: whole ones kept
    return out
