"""The multi-turn agent loop: model turns and tool / environment turns, token in, token out.

A trajectory starts from the row's chat prompt (with the tool schemas in it) and alternates:

    model turn   a `Request` (the trajectory's tokens so far) -> `Completion`; its token ids and
                 log-probs are appended exactly as sampled (mask 1) -- never decoded and re-encoded
    tool turn    the completion's text is parsed for tool calls (`format.py`, e.g. hermes); each
                 call runs (`tools.py`); the results are appended as the chat template's delta
                 tokens for those messages (mask 0, log-prob 0)
    env turn     (an environment instead of tools) `env.step(text)` -> message, reward, done

A tool's or environment's message may carry images (a VLM policy, `AgentSettings.processor`): its delta is the
processor's tokens for it, each image's `<|image_pad|>` run expanded (mask 0), and the trajectory keeps the images' pixel
inputs in order (`Trajectory.image_inputs`); every later request carries all of them (`ImageRequest`), and the training row
gets them as its `multi_modal_inputs` (`agent/images.py`).

until the model answers without a tool call, `max_assistant_turns` is reached, the environment is
done, or the trajectory's token budget (data.max_response_length) is spent. The result is one row:
`response_ids` with `response_mask` (1 = model token, 0 = tool / environment token) and per-token
rollout log-probs, so losses, KL, entropy and advantages (all masked) give tool tokens no gradient.

Many trajectories run at once on one asyncio loop. `RequestBatcher` sends whatever requests are
pending as one backend call (the HF backend batches them into one `generate`), in a thread, so a
tool that is slow (run in its own thread or sandbox process) delays only its own trajectory.
The backend call is injected (`generate_fn`): this module knows no Ray, no worker and no model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import inspect
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from hybridflow.agent.registry import class_registry
from hybridflow.agent.envs import Environment, env_name_for_row, make_env_for_row
from hybridflow.agent.format import get_format, message_delta_inputs, prompt_inputs
from hybridflow.agent.images import ImageError, decode_image, trajectory_image_inputs
from hybridflow.agent.threads import in_own_thread
from hybridflow.agent.tools import Tool, ToolResult, ToolSession, truncate_middle
from hybridflow.models.vlm_inputs import ImageRequest
from hybridflow.protocol import Completion, Request, SamplingParams

# one backend call, completions in order: blocking (run in a thread of its own) or a coroutine function (awaited)
GenerateFn = Callable[[list[Request]], Any]


@dataclass
class Trajectory:
    """One row of a multi-turn rollout: the prompt's ids and the response built turn by turn."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # 1 = sampled by the model, 0 = tool / environment
    log_probs: list[float] = field(default_factory=list)  # the backend's behaviour log-prob per model token, 0.0 elsewhere
    untruncated_log_probs: list[float] = field(default_factory=list)  # under the temperature alone (Completion's)
    versions: list[int] = field(default_factory=list)  # per token: the policy version that sampled it (-1: unknown)
    num_turns: int = 0  # assistant turns
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    tool_timeouts: int = 0  # tool calls / environment turns stopped at multi_turn.tool_timeout_s
    sandbox_kills: int = 0
    sandbox_weaker: int = 0  # sandbox runs without the full protections (no cgroup, seccomp or keyring)
    tool_control_chars: int = 0  # control characters removed from tool output before the model read it
    reward: float = 0.0  # sum of the tools' / environment's rewards
    finish: str = ""  # "answer" | "max_turns" | "length" | "env_done" | "truncated"
    finished_at: float = 0.0  # time.monotonic() when the trajectory ended
    # a black-box agent's session (openai_agent.py): requests whose plain rendering differed from the recorded
    # tokens (the recorded ones were trained), earlier segments not trained, and how the agent ended
    retokenization_mismatch: int = 0
    dropped_segments: int = 0
    sampling_overridden: int = 0
    agent_error: str = ""
    agent_timeout: bool = False
    session_kind: str = ""  # "openai": played by a black-box agent through the endpoint
    session: str = field(default_factory=lambda: uuid.uuid4().hex)  # its requests' session (one replica serves its turns)
    # per message with images, in order: (response tokens up to its end, 0 = the prompt's; its images' pixel inputs
    # {"pixel_values": [P, D], "image_grid_thw": [n, 3]}), so a branch cut at a message boundary keeps exactly its images
    image_inputs: list[tuple[int, dict]] = field(default_factory=list)

    @property
    def multi_modal_inputs(self) -> dict:
        """All its images' pixel inputs, in the order of their <|image_pad|> runs (the batch row's multi_modal_inputs; {} if none)."""
        return trajectory_image_inputs(self.image_inputs)

    def append(self, ids: Sequence[int], model: bool, log_probs: Sequence[float] | None = None,
               untruncated_log_probs: Sequence[float] | None = None, versions: Sequence[int] | None = None, images: dict | None = None) -> None:
        """versions: per model token, the policy version that sampled it (tool tokens, or a turn
        without versions, keep the last one's); images: the pixel inputs of the images whose tokens `ids` hold."""
        last = self.versions[-1] if self.versions else -1
        self.versions.extend([last] * len(ids) if versions is None else [int(v) for v in versions])
        self.response_ids.extend(int(t) for t in ids)
        self.response_mask.extend([1 if model else 0] * len(ids))
        zeros = [0.0] * len(ids)
        self.log_probs.extend(float(x) for x in (zeros if log_probs is None else log_probs))
        self.untruncated_log_probs.extend(float(x) for x in (zeros if untruncated_log_probs is None else untruncated_log_probs))
        if images:
            self.image_inputs.append((len(self.response_ids), images))


@dataclass(frozen=True)
class AgentSettings:
    """`actor_rollout_ref.rollout.multi_turn` plus what the loop needs from the rest of the config."""

    max_assistant_turns: int = 5
    max_tool_response_length: int = 256  # characters of one tool / environment message (middle cut)
    format: str = "hermes"
    response_budget: int = 256  # tokens of the whole response (model + tool), data.max_response_length
    default_agent: str | None = None  # rows without agent_name: "tool_agent" (or "env_agent" for env rows)
    black_box: Any = None  # openai_agent.BlackBoxAgent: rows without agent_name play through the endpoint
    endpoint: Any = None  # openai_server.EndpointSettings (with black_box)
    tool_timeout_s: float | None = 120.0  # one tool call / environment turn (awaited); past it the model reads an error
    processor: Any = None  # a VLM policy's processor: messages with images are tokenised by it (agent/images.py); None: text only


class SessionClosed(RuntimeError):
    """A request of a session that ended (its agent finished or timed out) before it was generated."""


class RequestBatcher:
    """Gathers the requests of every trajectory in flight; a backend call takes all that are pending
    (`max_in_flight` calls at once, by default one: the backend is a serial resource), run in a
    thread (or awaited) so tools go on meanwhile.
    Each call gets its own seed (`base.seed * 1000 + call index`), so turns do not repeat samples;
    a request with its own SamplingParams (the OpenAI endpoint's) keeps them, and its own seed when
    `seeded` (the backend runs requests of equal params as one batch: a seeded request samples what
    it samples alone when no other pending request has the same params)."""

    def __init__(self, generate_fn: GenerateFn, base: SamplingParams, max_in_flight: int = 1):
        """max_in_flight: backend calls at once (1: one at a time; more where the backend takes requests
        while it generates, e.g. replicas that batch continuously: a new turn need not wait for the
        slowest request of the call before it)."""
        self.generate_fn, self.base, self.max_in_flight = generate_fn, base, max_in_flight
        # (prompt ids, its max new tokens, session, its own params or None: the base's, seeded, its images' pixel inputs, result)
        self.pending: list[tuple[tuple[int, ...], int, str | None, SamplingParams | None, bool, dict | None, asyncio.Future]] = []
        self.calls = 0
        self.latencies: list[float] = []  # per answered request: seconds from submission to its completion
        self._task: asyncio.Task | None = None
        self.in_flight = 0  # backend calls running
        self._returned = asyncio.Event()  # set when a call returns
        self._running: set[asyncio.Task] = set()  # calls started without awaiting them (max_in_flight > 1)

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, session: str | None = None,
                       params: SamplingParams | None = None, seeded: bool = False, images: dict | None = None) -> Completion:
        """images: the pixel inputs of every image in the prompt, in order (its request goes out as an `ImageRequest`)."""
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((tuple(prompt_ids), max_new_tokens, session, params, seeded, images or None, fut))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        start = time.monotonic()
        out = await fut
        self.latencies.append(time.monotonic() - start)
        return out

    def take_latencies(self) -> list[float]:
        """The seconds each request waited for its completion (a model turn's latency), since the last take."""
        out, self.latencies = self.latencies, []
        return out

    def drop_session(self, session: str) -> None:
        """A session's requests still waiting for the backend are not sent: their callers get
        SessionClosed (a call already running is not stopped; its replies are not recorded)."""
        keep = []
        for entry in self.pending:
            if entry[2] == session:
                if not entry[-1].done():
                    entry[-1].set_exception(SessionClosed(f"session {session} ended before its request was generated"))
            else:
                keep.append(entry)
        self.pending = keep

    async def _drain(self) -> None:
        while self.pending:
            await asyncio.sleep(0)  # every trajectory that is ready adds its request first
            if self.in_flight >= self.max_in_flight:  # wait for a call to return (the pending ones join the next)
                self._returned.clear()
                await self._returned.wait()
                continue
            batch, self.pending = self.pending, []
            seed = self.base.seed * 1000 + self.calls
            self.calls += 1
            # Requests of equal settings share one SamplingParams, at the longest limit among them (the
            # HF backend batches equal params into one generate); each is cut to its own limit after.
            keys = [(p or self.base).with_(max_new_tokens=0, **({} if seeded else {"seed": seed})) for _, _, _, p, seeded, *_ in batch]
            longest: dict[SamplingParams, int] = {}
            for k, (_, n, *_) in zip(keys, batch):
                longest[k] = max(longest.get(k, 0), n)
            requests = [ImageRequest(ids, k.with_(max_new_tokens=longest[k]), session, images) if images else
                        Request(ids, k.with_(max_new_tokens=longest[k]), session) for k, (ids, _, session, _, _, images, _) in zip(keys, batch)]
            self.in_flight += 1
            if self.max_in_flight == 1:
                await self._call(batch, requests)
            else:  # the next call may start before this one returns
                task = asyncio.create_task(self._call(batch, requests))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    async def _call(self, batch: list, requests: list[Request]) -> None:
        """One backend call; its completions to their waiting requests (or its error to every one)."""
        try:
            if inspect.iscoroutinefunction(self.generate_fn):  # a backend that awaits its replicas (a rollout manager's)
                out = await self.generate_fn(requests)
            else:
                out = await in_own_thread(self.generate_fn, requests)
            if len(out) != len(requests):  # a request without its completion would wait forever
                raise RuntimeError(f"the rollout backend returned {len(out)} completions for {len(requests)} requests")
        except Exception as e:  # noqa: BLE001 - every waiting trajectory gets the backend's error
            for *_, f in batch:
                if not f.done():
                    f.set_exception(e)
            return
        finally:
            self.in_flight -= 1
            self._returned.set()
        for (_, n, *_, f), c in zip(batch, out):  # n: this request's own limit within the shared call
            if not f.done():  # its caller may have gone (a cancelled HTTP request)
                f.set_result(c if len(c.token_ids) <= n else c.cut(n))


AGENT_LOOPS: dict[str, type["AgentLoop"]] = {}


register_agent_loop = class_registry("agent loop", AGENT_LOOPS)
# Loops defined outside this module, imported on first use: name -> module.
BUILT_IN_LOOPS = {"openai_agent": "hybridflow.agent.openai_agent"}


class AgentLoop:
    """One trajectory per `run` call; subclasses decide what follows a model turn (`after_turn`)."""

    def __init__(self, tokenizer, settings: AgentSettings, tools: Sequence[Tool] = (), shared: Any = None):
        self.tok, self.s, self.tools, self.shared = tokenizer, settings, list(tools), shared  # shared: what step_resources gave
        self.fmt = get_format(settings.format)

    @classmethod
    def step_resources(cls, tokenizer, settings: AgentSettings, batcher: "RequestBatcher") -> contextlib.AbstractAsyncContextManager | None:
        """An async context manager entered once per step around this class's trajectories (what it
        yields reaches each instance as `shared`); None: nothing shared."""
        return None

    def first_messages(self, row: Mapping[str, Any]) -> list[dict]:
        return [dict(m) for m in row["raw_prompt"]]

    async def setup(self, row: Mapping[str, Any]) -> None:
        """Per-trajectory state (tool instances, an environment) before the first turn."""

    async def teardown(self) -> None:
        """Release what `setup` made."""

    async def after_turn(self, traj: Trajectory, text: str) -> list[dict] | None:
        """The messages that answer the model's turn `text` (appended as delta tokens), or None: done."""
        return None

    async def run(self, row: Mapping[str, Any], batcher: RequestBatcher) -> Trajectory:
        await self.setup(row)
        try:
            return await self._run(row, batcher)
        finally:
            await self.teardown()

    async def _run(self, row: Mapping[str, Any], batcher: RequestBatcher) -> Trajectory:
        schemas = [t.schema for t in self.tools]
        ids, images = prompt_inputs(self.tok, self.first_messages(row), schemas, self.s.format, self.s.processor)
        traj = Trajectory(prompt_ids=ids, image_inputs=[(0, images)] if images else [])
        budget = self.s.response_budget
        while True:
            left = budget - len(traj.response_ids)
            if left <= 0:
                traj.finish = "length"
                break
            c = await batcher.generate(traj.prompt_ids + traj.response_ids, left, traj.session, images=traj.multi_modal_inputs)
            traj.append(c.token_ids, model=True, log_probs=c.log_probs, untruncated_log_probs=c.untruncated, versions=c.versions)
            traj.num_turns += 1
            if c.finish_reason != "stop":  # cut by the budget: the turn never closed, nothing may follow it
                traj.finish = "length"
                break
            reply = await self.after_turn(traj, self.tok.decode(list(c.token_ids), skip_special_tokens=True))
            if reply is None:
                traj.finish = traj.finish or "answer"
                break
            if traj.num_turns >= self.s.max_assistant_turns:
                traj.finish = "max_turns"
                break
            delta, images = message_delta_inputs(self.tok, reply, self.s.processor, add_generation_prompt=True, after_eos=True)
            if len(traj.response_ids) + len(delta) >= budget:  # no room for the reply and another model token
                traj.finish = "truncated"
                break
            traj.append(delta, model=False, images=images)
        traj.finished_at = time.monotonic()
        return traj

    def clip(self, text: str) -> str:
        return truncate_middle(text, self.s.max_tool_response_length)

    def _shown(self, result: ToolResult, name: str) -> ToolResult:
        """What the model reads of a tool's result: its text clipped, its images decoded (a tool's image that cannot be
        decoded becomes an error the model reads). ValueError: images for a text-only policy (a setup error, not the model's)."""
        if self.s.processor is not None:  # the image token spelled in a tool's text would be a place with no pixels behind it
            result = dataclasses.replace(result, text=result.text.replace(getattr(self.s.processor, "image_token", "<|image_pad|>"), ""))
        if not result.images:
            return dataclasses.replace(result, text=self.clip(result.text))
        if self.s.processor is None:
            raise ValueError(f"tool {name!r} returned {len(result.images)} image(s), but the policy is a text-only model (no image "
                             f"processor): a tool for it must return text")
        try:
            images = [decode_image(im) for im in result.images]
        except ImageError as e:
            return ToolResult(self.clip(f"Error: tool {name!r} returned an image that cannot be shown: {e}"), error=True)
        return dataclasses.replace(result, text=self.clip(result.text), images=images)


@register_agent_loop("single_turn_agent")
class SingleTurnAgentLoop(AgentLoop):
    """One model turn (the single-turn rollout as a trajectory; verl's name)."""


@register_agent_loop("tool_agent")
class ToolAgentLoop(AgentLoop):
    """Tool calls in the model's text run and their results come back as tool messages."""

    async def setup(self, row: Mapping[str, Any]) -> None:
        extra = row.get("extra_info") or {}
        self.session = ToolSession(self.tools, tools_kwargs=extra.get("tools_kwargs"))

    async def teardown(self) -> None:
        await self.session.close()

    async def after_turn(self, traj: Trajectory, text: str) -> list[dict] | None:
        parsed = self.fmt.parse(text)
        if not parsed.calls and not parsed.errors:
            return None
        replies = []
        for call in parsed.calls:
            t0 = time.monotonic()
            try:
                result: ToolResult = await asyncio.wait_for(self.session.call(call), self.s.tool_timeout_s)
            except (asyncio.TimeoutError, TimeoutError):  # a tool with no deadline of its own: the trajectory goes on
                traj.tool_timeouts += 1
                result = ToolResult(f"Error: tool {call.name!r} ran past multi_turn.tool_timeout_s={self.s.tool_timeout_s}", error=True)
            traj.tool_seconds += time.monotonic() - t0
            traj.tool_calls += 1
            traj.tool_errors += int(result.error)
            traj.sandbox_kills += int(bool(result.metrics.get("sandbox_killed", 0)))
            traj.sandbox_weaker += int(result.metrics.get("sandbox_weaker", 0))
            traj.tool_control_chars += int(result.metrics.get("control_chars", 0))
            traj.reward += float(result.reward)
            replies.append(self.fmt.tool_message(self._shown(result, call.name), name=call.name))
        for err in parsed.errors:  # a malformed call: the model reads why
            traj.tool_calls += 1
            traj.tool_errors += 1
            replies.append(self.fmt.tool_message(self.clip(f"Error: {err}")))
        return replies


@register_agent_loop("env_agent")
class EnvAgentLoop(AgentLoop):
    """An environment (`envs.py`, chosen per row) answers every model turn until it is done."""

    def first_messages(self, row: Mapping[str, Any]) -> list[dict]:
        messages = [dict(m) for m in row.get("raw_prompt") or []]
        return messages if messages else [{"role": "user", "content": self.first}]

    async def setup(self, row: Mapping[str, Any]) -> None:
        env = make_env_for_row(row)
        if env is None:
            raise ValueError("env_agent: the row names no environment (extra_info.env or extra_info.interaction_kwargs.name)")
        self.env: Environment = env
        self.first = await env.areset(row)

    async def teardown(self) -> None:
        env = getattr(self, "env", None)
        if env is not None:
            await env.aclose()

    async def after_turn(self, traj: Trajectory, text: str) -> list[dict] | None:
        try:
            message, reward, done = await asyncio.wait_for(self.env.astep(text), self.s.tool_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):  # an environment that stopped answering ends its trajectory
            traj.tool_timeouts += 1
            traj.finish = "env_timeout"
            return None
        traj.reward += float(reward)
        if done:
            traj.finish = "env_done"
            return None
        if isinstance(message, list):  # content parts: text and images (a VLM policy; agent/images.py)
            return [{"role": "user", "content": [dict(p, text=self.clip(p["text"])) if p.get("type") == "text" else p for p in message]}]
        return [{"role": "user", "content": self.clip(message)}]


def agent_name_for(row: Mapping[str, Any], settings: AgentSettings, has_tools: bool) -> str:
    """The row's `agent_name` (or extra_info.agent_name); else env_agent for a row naming an
    environment, tool_agent with tools, single_turn_agent otherwise."""
    extra = row.get("extra_info") or {}
    name = row.get("agent_name") or extra.get("agent_name") or settings.default_agent
    if not name and settings.black_box is not None:
        name = "openai_agent"
    if not name:
        name = "env_agent" if env_name_for_row(row) is not None else ("tool_agent" if has_tools else "single_turn_agent")
    if name not in AGENT_LOOPS and name in BUILT_IN_LOOPS:  # registered when its module is first imported (it imports this one)
        importlib.import_module(BUILT_IN_LOOPS[name])
    if name not in AGENT_LOOPS:
        raise ValueError(f"unknown agent_name {name!r}; registered agent loops: {sorted(set(AGENT_LOOPS) | set(BUILT_IN_LOOPS))}")
    return name


async def run_trajectories(rows: Sequence[Mapping[str, Any]], generate_fn: GenerateFn, tokenizer, settings: AgentSettings,
                           params: SamplingParams, tools: Sequence[Tool] = (), resources: Mapping[str, Any] | None = None,
                           max_in_flight: int = 1) -> tuple[list[Trajectory], RequestBatcher]:
    """Every row's trajectory, all in flight at once; in row order. resources: per agent loop name,
    what its trajectories share instead of `step_resources` (a rollout manager's endpoint, served
    for the whole run); max_in_flight: the batcher's backend calls at once."""
    batcher = RequestBatcher(generate_fn, params, max_in_flight)
    names = [agent_name_for(row, settings, bool(tools)) for row in rows]
    classes = [AGENT_LOOPS[name] for name in names]
    given = dict(resources or {})
    async with contextlib.AsyncExitStack() as stack:
        shared = {}  # per loop class: what its trajectories of this step share (e.g. openai_agent's endpoint)
        for name, cls in dict(zip(names, classes)).items():
            if name in given:
                shared[cls] = given[name]
                continue
            cm = cls.step_resources(tokenizer, settings, batcher)
            shared[cls] = None if cm is None else await stack.enter_async_context(cm)
        trajs = await asyncio.gather(*(cls(tokenizer, settings, tools, shared[cls]).run(row, batcher) for row, cls in zip(rows, classes)))
    return list(trajs), batcher


def trajectory_totals(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """The sums (and the one maximum, `num_turns_max`) that agent/* metrics are made of: additive, so a
    rollout manager sends its shard's totals and the driver adds them (`add_totals`), never the trajectories."""
    out = {"trajectories": float(len(trajs)), "num_turns": 0.0, "num_turns_max": 0.0, "tool_calls": 0.0, "tool_errors": 0.0, "tool_seconds": 0.0,
           "tool_timeouts": 0.0, "sandbox_kills": 0.0, "sandbox_weaker": 0.0, "tool_control_chars": 0.0, "model_tokens": 0.0, "tool_tokens": 0.0,
           "solved": 0.0, "solved_turns": 0.0, "openai": 0.0, "retokenization_mismatch": 0.0, "dropped_segments": 0.0, "agent_errors": 0.0,
           "agent_timeouts": 0.0, "sampling_overridden": 0.0}
    for t in trajs:
        model = sum(t.response_mask)
        out["num_turns"] += t.num_turns
        out["num_turns_max"] = max(out["num_turns_max"], float(t.num_turns))
        for k in ("tool_calls", "tool_errors", "tool_seconds", "tool_timeouts", "sandbox_kills", "sandbox_weaker", "tool_control_chars",
                  "retokenization_mismatch", "dropped_segments", "sampling_overridden"):
            out[k] += getattr(t, k)
        out["model_tokens"] += model
        out["tool_tokens"] += len(t.response_mask) - model
        if t.reward > 0:  # a trajectory a tool / environment rewarded
            out["solved"] += 1
            out["solved_turns"] += t.num_turns
        out["openai"] += t.session_kind == "openai"
        out["agent_errors"] += bool(t.agent_error)
        out["agent_timeouts"] += t.agent_timeout
    return out


def add_totals(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Shards' `trajectory_totals` as one step's."""
    out = trajectory_totals(())
    for part in parts:
        for k, v in part.items():
            out[k] = max(out[k], v) if k == "num_turns_max" else out[k] + v
    return out


def trajectory_metrics(trajs: Sequence[Trajectory], batcher: RequestBatcher | None = None, generate_calls: int | None = None,
                       latencies: Sequence[float] = ()) -> dict[str, float]:
    """verl-style agent/* metrics of one step's trajectories; latencies: its model turns' (seconds)."""
    return metrics_from_totals(trajectory_totals(trajs), batcher.calls if batcher is not None else generate_calls, latencies)


def metrics_from_totals(totals: dict[str, float], generate_calls: int | None = None, latencies: Sequence[float] = ()) -> dict[str, float]:
    """verl-style agent/* metrics from a step's `trajectory_totals`; latencies: its model turns' (seconds)."""
    n = max(totals["trajectories"], 1.0)
    out = {
        "agent/num_turns/mean": totals["num_turns"] / n, "agent/num_turns/max": totals["num_turns_max"],
        "agent/tool_calls/mean": totals["tool_calls"] / n,
        "agent/tool_errors": totals["tool_errors"],
        "agent/tool_seconds/mean": totals["tool_seconds"] / n,
        "agent/tool_timeouts": totals["tool_timeouts"],
        "agent/sandbox_kills": totals["sandbox_kills"],
        "agent/sandbox_weaker": totals["sandbox_weaker"],
        "agent/tool_control_chars": totals["tool_control_chars"],
        "agent/model_tokens/mean": totals["model_tokens"] / n,
        "agent/tool_tokens/mean": totals["tool_tokens"] / n,
    }
    if totals["solved"]:
        out["agent/num_turns/solved_mean"] = totals["solved_turns"] / totals["solved"]
    if latencies:
        ordered = sorted(latencies)
        out["agent/requests"] = float(len(ordered))  # model turns answered (a black-box agent's every request)
        out["agent/turn_latency_s/p50"] = ordered[len(ordered) // 2]
        out["agent/turn_latency_s/p99"] = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    if generate_calls is not None:
        out["agent/generate_calls"] = float(generate_calls)
    if totals["openai"]:
        for k in ("retokenization_mismatch", "dropped_segments", "agent_errors", "agent_timeouts", "sampling_overridden"):
            out[f"agent/{k}"] = totals[k]
    return out
