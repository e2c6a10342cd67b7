"""An OpenAI-compatible endpoint in front of the rollout: black-box agents generate through it.

    GET  /v1/models                                   the served model (any session's key)
    POST /sessions/{id}/v1/chat/completions           messages, tools, tool_choice, n, temperature, top_p,
                                                      max_tokens | max_completion_tokens, stop, seed, logprobs
    POST /sessions/{id}/v1/completions                prompt (text or token ids), the same sampling fields
    GET  /sessions/{id}/v1/models

A session is one trajectory (`sessions.Session`): an unmodified client only needs its base URL
(`.../sessions/{id}/v1`) and its key (`Authorization: Bearer`, the session's own random key; another
session's key gets 403). Requests go through the step's `RequestBatcher`, so they batch with every
other trajectory in flight and reach the rollout pool like the built-in agent loop's. Every reply
carries its token ids (`choices[i].token_ids`, `prompt_token_ids`: extensions an OpenAI client keeps).

Hostile input (the agent is the policy's doing): the server binds 127.0.0.1 unless told otherwise;
bodies are capped (413), JSON parsed by us (400 on anything malformed), every field type- and
range-checked, max_tokens bounded by the trajectory's remaining token budget (400 past it),
unknown models / sessions / routes 404; every error is an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}`, and no request can raise into the run.
Streaming is not served (400 naming `stream`), nor `response_format` other than text or `echo`
(400 naming the field: refused rather than ignored); a body nested too deeply or holding a lone
UTF-16 surrogate is a 400 too.

Images (a vision-language policy: the endpoint is given its processor): user and tool messages may hold
OpenAI's ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` parts. Each is decoded
when the request arrives (raster formats only, `agent/images.py`), so a remote URL (never fetched), bad
base64, bytes that are no image, an image over `images.MAX_IMAGE_PIXELS`, an image in a system or assistant
message, or any image sent to a text-only model gets a 400 naming ``messages[i].content[j].image_url``; the
session records the images' placeholder tokens (mask 0) and pixel inputs with the segment (`sessions.py`).

Sampling during training: temperature / top_p / top_k are the run's (`rollout.*`, or val_kwargs
in validation), since the trainer's log-probs are computed under them; a request asking for
others is served with the run's and counted (`agent/sampling_overridden`). `sampling="request"`
(benches, tests) serves the request's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hybridflow.agent.format import get_format
from hybridflow.agent.images import ImageError, decode_image, image_digest
from hybridflow.agent.loop import SessionClosed
from hybridflow.agent.sessions import Session
from hybridflow.protocol import Completion, SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 8  # choices per request
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # top_logprobs (OpenAI's limit)


KEEP_ALIVE_S = 75  # an idle HTTP connection is kept this long (clients close theirs sooner)

class APIError(Exception):
    """An error answered to the client: HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "invalid_request_error",
                429: "rate_limit_error"}.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class EndpointSettings:
    """What the endpoint needs from the run (actor_rollout_ref.rollout.agent and the data budgets)."""

    model_name: str  # what /v1/models lists and requests must name
    response_budget: int  # tokens of one trajectory's response, data.max_response_length
    max_prompt_tokens: int  # data.max_prompt_length
    fmt: str = "hermes"  # the tool-call format (multi_turn.format)
    host: str = "127.0.0.1"
    port: int = 0
    max_request_bytes: int = 1_048_576
    max_messages: int = 256
    sampling: Literal["run", "request"] = "run"
    unix_socket: bool = False  # serve on a Unix socket as well (`socket_path`): sandboxed agents reach it through it
    # per session (actor_rollout_ref.rollout.agent.max_session_*): in flight at once, in all, segments, sampled tokens
    max_session_concurrency: int = 8
    max_session_requests: int = 256
    max_session_segments: int = 32
    max_session_tokens: int = 1 << 30


@dataclass
class Counters:
    errors: dict[int, int] = field(default_factory=dict)  # status -> count
    sampling_overridden: int = 0


class LiveEndpoint:
    """The endpoint of one step: its sessions, served on the step's asyncio loop (`serve`)."""

    def __init__(self, settings: EndpointSettings, tokenizer: Any, batcher: Any, processor: Any = None):
        """batcher: loop.RequestBatcher; processor: a VLM's (messages may carry images), None for a text model."""
        self.s, self.tok, self.batcher, self.processor = settings, tokenizer, batcher, processor
        self.sessions: dict[str, Session] = {}
        self.counters = Counters()
        self.stop_ids = {int(tokenizer.eos_token_id), *batcher.base.stop_token_ids}
        self.base_url = ""  # http://host:port once serving
        self.socket_path = ""  # with settings.unix_socket, once serving: mode 0666 in a 0711 directory of its own
        self.http = None  # httpx.AsyncClient for in-process agents, while serving
        self.app = self._build_app()

    # ------------------------------------------------------------------ sessions
    def open_session(self) -> Session:
        sid = uuid.uuid4().hex
        s = Session(sid, self.tok, self.s.fmt, self.s.response_budget, self.s.max_prompt_tokens, self.processor)
        self.sessions[sid] = s
        return s

    def close_session(self, session: Session) -> None:
        """The trajectory is done (its agent ended or timed out): its requests still waiting for the
        backend are dropped (they get 410), later ones are refused."""
        session.closed = True
        self.batcher.drop_session(session.id)

    def url(self, session: Session, base: str | None = None) -> str:
        """The session's OpenAI base URL (on `base` instead of where this serves: a sandbox's bridge)."""
        return f"{base or self.base_url}/sessions/{session.id}/v1"

    @contextlib.asynccontextmanager
    async def serve(self):
        """Serve on the running loop (uvicorn, a free port unless settings.port; with settings.unix_socket
        also on a Unix socket) until the block ends."""
        servers: list[tuple[uvicorn.Server, asyncio.Task]] = []
        with contextlib.ExitStack() as cleanup:
            where = [{"host": self.s.host, "port": self.s.port}]
            if self.s.unix_socket:
                # Sandboxed agents run as another user (nobody): the directory lets them reach the socket
                # (0711: not list it), the socket's 0666 lets them connect. Sessions still need their keys.
                folder = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="hybridflow-endpoint-"))
                os.chmod(folder, 0o711)
                where.append({"uds": os.path.join(folder, "endpoint.sock")})
            try:
                for w in where:
                    servers.append(await self._start(**w))
                host, port = servers[0][0].servers[0].sockets[0].getsockname()[:2]
                self.base_url = f"http://{host}:{port}"
                self.socket_path = where[-1].get("uds", "")
                logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per agent request at INFO would drown the run's log
                # One connection pool for the in-process agents' clients (a client per trajectory would build
                # an SSL context and a pool each: ~20 ms of CPU apiece).
                self.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=5.0),
                                              timeout=None)
                try:
                    yield self
                finally:
                    await self.http.aclose()
            finally:
                for server, task in servers:
                    server.should_exit = True
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(task, 5)

    async def _start(self, **where) -> tuple[uvicorn.Server, asyncio.Task]:
        # Keep-alive: the server holds an idle connection far longer than clients do (httpx: 5 s). With equal
        # limits a client reuses a connection the server is closing at that moment, and its request fails with a
        # connection error (seen: 2 of 3,000 turns at 1,000 sessions), which no agent should have to retry.
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1,
                                timeout_keep_alive=KEEP_ALIVE_S, **where)
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # the driver owns its signals (and may not be the main thread)
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()  # the bind failed: raise why
                raise RuntimeError(f"the agent endpoint did not start on {where}")
            await asyncio.sleep(0.01)
        return server, task

    # ------------------------------------------------------------------ HTTP
    def _build_app(self):
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        def error(e: APIError) -> JSONResponse:
            self.counters.errors[e.status] = self.counters.errors.get(e.status, 0) + 1
            return JSONResponse(e.body(), status_code=e.status)

        async def handle(request: Request, work) -> JSONResponse:
            try:
                return JSONResponse(await work())
            except APIError as e:
                return error(e)
            except SessionClosed as e:  # its agent ended while the request waited for the backend
                return error(APIError(410, str(e), code="session_closed"))
            except Exception as e:  # noqa: BLE001 - a request never raises into the run
                return error(APIError(500, f"{type(e).__name__}: {e}"[:500], code="internal_error"))

        @app.get("/v1/models")
        async def models(request: Request):
            return await handle(request, lambda: self._models(request, None))

        @app.get("/sessions/{sid}/v1/models")
        async def session_models(request: Request, sid: str):
            return await handle(request, lambda: self._models(request, sid))

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def chat(request: Request, sid: str):
            return await handle(request, lambda: self._chat(request, sid))

        @app.post("/sessions/{sid}/v1/completions")
        async def completions(request: Request, sid: str):
            return await handle(request, lambda: self._completions(request, sid))

        @app.exception_handler(404)
        async def not_found(request: Request, exc):
            return error(APIError(404, f"no route {request.method} {request.url.path}; an agent's base URL is "
                                       f"/sessions/<id>/v1 (given to it as OPENAI_BASE_URL)", code="not_found"))

        @app.exception_handler(405)
        async def not_allowed(request: Request, exc):
            return error(APIError(405, f"method {request.method} not allowed on {request.url.path}", code="method_not_allowed"))

        return app

    def _key(self, request) -> str:
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer ") or not auth[7:].strip():
            raise APIError(401, "missing API key: send Authorization: Bearer <key> (OPENAI_API_KEY)", code="invalid_api_key")
        return auth[7:].strip()

    def _session(self, request, sid: str) -> Session:
        key = self._key(request)
        s = self.sessions.get(sid)
        if s is None:
            raise APIError(404, f"no session {sid[:40]!r} in this run", code="session_not_found")
        if not secrets.compare_digest(key, s.key):
            if self._known_key(key):
                raise APIError(403, "this key belongs to another session", code="wrong_session")
            raise APIError(401, "invalid API key", code="invalid_api_key")
        if s.closed:
            raise APIError(410, f"session {sid} has ended (its trajectory is done)", code="session_closed")
        return s

    def _admit(self, session: Session, plan) -> None:
        """The session's own limits (EndpointSettings.max_session_*), before anything is recorded."""
        s = self.s
        if session.requests_in_flight >= s.max_session_concurrency:
            raise APIError(429, f"this session has {s.max_session_concurrency} requests in flight "
                                "(actor_rollout_ref.rollout.agent.max_session_concurrency)", code="rate_limit_exceeded")
        if session.requests >= s.max_session_requests:
            raise APIError(429, f"this session has made its {s.max_session_requests} requests "
                                "(actor_rollout_ref.rollout.agent.max_session_requests)", code="rate_limit_exceeded")
        if plan.segment is None and len(session.segments) >= s.max_session_segments:
            raise APIError(400, f"this session has opened {s.max_session_segments} conversations (segments); a request that "
                                "extends none of them would open another (actor_rollout_ref.rollout.agent.max_session_segments)",
                           param="messages", code="context_length_exceeded")
        if self._tokens_left(session) <= 0:
            raise APIError(400, f"this session has used its {s.max_session_tokens} sampled tokens "
                                "(actor_rollout_ref.rollout.agent.max_session_tokens)", param="max_tokens", code="context_length_exceeded")

    def _tokens_left(self, session: Session) -> int:
        return self.s.max_session_tokens - session.sampled - session.reserved

    def _known_key(self, key: str) -> bool:
        return any(secrets.compare_digest(key, s.key) for s in self.sessions.values())

    async def _models(self, request, sid: str | None) -> dict:
        if sid is None:
            if not self._known_key(self._key(request)):
                raise APIError(401, "invalid API key", code="invalid_api_key")
        else:
            self._session(request, sid)
        return {"object": "list", "data": [{"id": self.s.model_name, "object": "model", "created": 0, "owned_by": "hybridflow"}]}

    async def _body(self, request) -> dict:
        limit = self.s.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise APIError(413, f"request body over {limit} bytes (actor_rollout_ref.rollout.agent.max_request_bytes)", code="too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body over {limit} bytes", code="too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON ({e})"[:300], code="invalid_json") from None
        except RecursionError:  # e.g. 20,000 nested arrays: the parser's recursion limit, not a server fault
            raise APIError(400, "the body's JSON is nested too deeply", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        where = _lone_surrogate(body)
        if where is not None:  # valid JSON ("\ud800"), but no UTF-8 text: the tokenizer and every log would fail on it
            raise APIError(400, f"{where} holds a lone UTF-16 surrogate (\\ud800-\\udfff): not text", param=where,
                           code="invalid_json")
        for field_name, honoured in (("response_format", lambda v: v in (None, {"type": "text"})),
                                     ("echo", lambda v: v in (None, False))):
            if not honoured(body.get(field_name)):  # refused, not silently ignored: the client would trust it
                raise APIError(400, f"{field_name}={str(body.get(field_name))[:60]} is not supported by this endpoint "
                               "(no constrained decoding, no echo)", param=field_name, code="unsupported")
        if body.get("model") != self.s.model_name:
            raise APIError(404, f"model {str(body.get('model'))[:80]!r} does not exist; this endpoint serves {self.s.model_name!r}",
                           param="model", code="model_not_found")
        if body.get("stream"):
            raise APIError(400, "stream=true is not supported by this endpoint", param="stream", code="unsupported")
        return body

    # ------------------------------------------------------------------ completions
    async def _chat(self, request, sid: str) -> dict:
        session = self._session(request, sid)
        body = await self._body(request)
        messages = _images(_messages(body.get("messages"), self.s.max_messages), self.processor is not None)
        tools = _tools(body.get("tools"))
        choice = _tool_choice(body.get("tool_choice"), tools)
        try:
            plan = session.plan(messages, tools)
        except ImageError as e:  # e.g. a text that spells the image token
            raise APIError(400, str(e)[:500], param="messages", code="invalid_image") from None
        except ValueError as e:
            raise APIError(400, str(e), param="messages", code="context_length_exceeded") from None
        self._admit(session, plan)
        params, seeded, n, want_logprobs = self._params(body, min(plan.left, self._tokens_left(session)), session, chat=True)
        prompt, seg = plan.ids, session.place(plan, params.max_new_tokens * n)  # every check passed: recorded from here on
        try:
            completions, choices = await self._chat_choices(session, seg, messages, tools, choice, prompt, params, seeded, n, want_logprobs,
                                                            session.segments[seg].multi_modal_inputs)
        finally:
            session.release(seg)
        return self._reply("chat.completion", prompt, completions, choices)

    async def _chat_choices(self, session: Session, seg: int, messages, tools, choice, prompt, params: SamplingParams, seeded: bool,
                            n: int, want_logprobs: bool, images: dict | None = None) -> tuple[list, list]:
        """Generate the n choices of a placed chat request and record them in its segment (the first)
        and branches of it (the others). images: the pixel inputs of every image in the prompt, in order."""
        completions = await asyncio.gather(*(self.batcher.generate(prompt, params.max_new_tokens, session.id, params, seeded, images)
                                             for _ in range(n)))
        fmt = get_format(self.s.fmt)
        choices = []
        base_len = len(session.segments[seg].response_ids)  # the segment before any choice: choices after the first branch from here
        for i, c in reversed(list(enumerate(completions))):  # the first choice recorded last: the one trained unless another is continued
            text = self._text(c, params)
            parsed = fmt.parse(text) if tools and choice != "none" else None
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = c.finish_reason
            if parsed is not None and parsed.calls and not parsed.errors:
                message = {"role": "assistant", "content": parsed.content or None, "tool_calls": [
                    {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                     "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}} for call in parsed.calls]}
                finish = "tool_calls" if c.finish_reason == "stop" else finish
            session.record(seg if i == 0 else session.branch(seg, base_len), messages, c, message, self.stop_ids)
            if i == 0:
                session.tool_calls += len(message.get("tool_calls") or ())
            choices.insert(0, {"index": i, "message": message, "finish_reason": finish, "token_ids": list(c.token_ids),
                               "logprobs": self._logprobs(c) if want_logprobs else None})
        return completions, choices

    async def _completions(self, request, sid: str) -> dict:
        session = self._session(request, sid)
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            if len(prompt) > 4 * self.s.max_request_bytes:
                raise APIError(400, "prompt too long", param="prompt")
            ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self.tok)
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            ids = prompt
        else:
            raise APIError(400, "prompt must be a non-empty string or a list of token ids", param="prompt")
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        try:
            plan = session.plan_ids(ids)
        except ImageError as e:
            raise APIError(400, str(e)[:500], param="prompt", code="invalid_image") from None
        except ValueError as e:
            raise APIError(400, str(e), param="prompt", code="context_length_exceeded") from None
        self._admit(session, plan)
        params, seeded, n, want_logprobs = self._params(body, min(plan.left, self._tokens_left(session)), session, chat=False)
        if n != 1:
            raise APIError(400, "n > 1 is not supported on /v1/completions (one continuation per segment)", param="n")
        ids, seg = plan.ids, session.place(plan, params.max_new_tokens)
        try:
            c = await self.batcher.generate(ids, params.max_new_tokens, session.id, params, seeded, session.segments[seg].multi_modal_inputs)
            session.record(seg, None, c, None, self.stop_ids)
        finally:
            session.release(seg)
        choices = [{"index": 0, "text": self._text(c, params), "finish_reason": c.finish_reason, "token_ids": list(c.token_ids),
                    "logprobs": {"tokens": [self.tok.decode([t]) for t in c.token_ids], "token_logprobs": list(c.log_probs),
                                 "top_logprobs": [{self.tok.decode([t]): v for t, v in top} for top in c.top_logprobs]
                                 if c.top_logprobs is not None else None}
                    if want_logprobs else None}]
        return self._reply("text_completion", ids, [c], choices)

    def _params(self, body: Mapping[str, Any], left: int, session: Session, chat: bool) -> tuple[SamplingParams, bool, int, bool]:
        """(params, seeded, n, logprobs) from the request's fields, checked; max tokens bounded by `left`.
        chat: OpenAI's chat fields (logprobs: bool, top_logprobs: k), else the completions' (logprobs: k)."""
        base = self.batcher.base
        n = _int(body, "n", 1, 1, MAX_N)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if max_tokens is None:
            max_tokens = left
        elif not _is_int(max_tokens) or max_tokens < 1:
            raise APIError(400, f"{param} must be a positive integer, got {str(max_tokens)[:40]}", param=param)
        elif max_tokens > left:
            raise APIError(400, f"{param}={max_tokens} is over this trajectory's remaining token budget ({left}; "
                                f"data.max_response_length counts the model's and the messages' tokens)", param=param, code="context_length_exceeded")
        temperature = _float(body, "temperature", None, 0.0, 2.0)
        top_p = _float(body, "top_p", None, 0.0, 1.0)
        if top_p == 0.0:
            raise APIError(400, "top_p must be in (0, 1]", param="top_p")
        stop = body.get("stop")
        stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOPS or not all(isinstance(x, str) and 0 < len(x) <= 64 for x in stops):
            raise APIError(400, f"stop must be a string or up to {MAX_STOPS} non-empty strings of at most 64 characters", param="stop")
        seed = body.get("seed")
        if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**31):
            raise APIError(400, "seed must be an integer in [0, 2**31)", param="seed")
        logprobs, top = body.get("logprobs", False), body.get("top_logprobs")
        if chat:
            if not isinstance(logprobs, bool):
                raise APIError(400, "logprobs must be a boolean", param="logprobs")
            if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS or (top and not logprobs)):
                raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], with logprobs=true", param="top_logprobs")
        else:  # /v1/completions: logprobs=k is the sampled token's log-prob and the k most likely besides
            if logprobs is not None and logprobs is not False and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
                raise APIError(400, f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
            logprobs, top = logprobs is not None and logprobs is not False, logprobs or 0
        params = base.with_(max_new_tokens=int(max_tokens), stop=tuple(dict.fromkeys([*base.stop, *stops])),
                            seed=int(seed) if seed is not None else base.seed, top_logprobs=int(top or 0))
        asked = {k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None}
        if self.s.sampling == "request":
            params = params.with_(do_sample=asked.get("temperature", 1.0) > 0, **asked)
        elif any(getattr(base, k) != v for k, v in asked.items()):
            self.counters.sampling_overridden += 1
            session.sampling_overridden += 1
        return params, seed is not None, n, bool(logprobs)

    def _text(self, c: Completion, params: SamplingParams) -> str:
        text = self.tok.decode(list(c.token_ids), skip_special_tokens=True)
        for s in params.stop:  # OpenAI returns the text before a stop string (the tokens keep it)
            if c.finish_reason == "stop" and s in text:
                text = text[: text.index(s)]
        return text

    def _logprobs(self, c: Completion) -> dict:
        def entry(t: int, lp: float) -> dict:
            s = self.tok.decode([t])
            return {"token": s, "logprob": float(lp), "bytes": list(s.encode())}

        tops = c.top_logprobs or [()] * len(c.token_ids)
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(*x) for x in top]} for t, lp, top in zip(c.token_ids, c.log_probs, tops)]}

    def _reply(self, kind: str, prompt: list[int], completions: list[Completion], choices: list[dict]) -> dict:
        used = sum(len(c.token_ids) for c in completions)
        return {"id": ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex, "object": kind, "created": int(time.time()),
                "model": self.s.model_name, "choices": choices, "prompt_token_ids": list(prompt),
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": used, "total_tokens": len(prompt) + used}}


# ---------------------------------------------------------------------- request checks
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(body: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    x = body.get(key, default)
    if x is None:
        return default
    if not _is_int(x) or not lo <= x <= hi:
        raise APIError(400, f"{key} must be an integer in [{lo}, {hi}], got {str(x)[:40]}", param=key)
    return x


def _float(body: Mapping[str, Any], key: str, default: float | None, lo: float, hi: float) -> float | None:
    x = body.get(key, default)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi:
        raise APIError(400, f"{key} must be a number in [{lo}, {hi}], got {str(x)[:40]}", param=key)
    return float(x)


def _messages(messages: Any, limit: int) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    if len(messages) > limit:
        raise APIError(400, f"{len(messages)} messages; at most {limit} (actor_rollout_ref.rollout.agent.max_messages)", param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        if m.get("role") not in ROLES:
            raise APIError(400, f"{where}.role must be one of {list(ROLES)}, got {str(m.get('role'))[:40]!r}", param=f"{where}.role")
        content = m.get("content")
        ok = content is None or isinstance(content, str) or (
            isinstance(content, list) and all(isinstance(p, dict) and (p.get("type") == "text" and isinstance(p.get("text"), str)
                                                                       or p.get("type") == "image_url") for p in content))
        if not ok:
            raise APIError(400, f"{where}.content must be a string or a list of text and image_url parts", param=f"{where}.content")
        if content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise APIError(400, f"{where}.content is missing", param=f"{where}.content")
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise APIError(400, f"{where}.tool_calls: only an assistant message carries a list of tool calls", param=f"{where}.tool_calls")
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                args = fn.get("arguments") if isinstance(fn, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(args, str) or not _is_json_object(args):
                    raise APIError(400, f"{where}.tool_calls: each needs function.name and function.arguments (a JSON object string)",
                                   param=f"{where}.tool_calls")
    return messages


def _images(messages: list[dict], vision: bool) -> list[dict]:
    """The messages with each image_url part decoded: ``{"type": "image", "image": <RGB PIL image>, "digest": ...}`` (the
    digest of its URL identifies it when the agent sends the history again). A 400 naming messages[i].content[j].image_url
    for an image the model cannot take (a text-only model; a system or assistant message) or that cannot be decoded."""
    out = messages
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list) or not any(p.get("type") == "image_url" for p in content):
            continue
        parts = []
        for j, p in enumerate(content):
            if p.get("type") != "image_url":
                parts.append(p)
                continue
            where = f"messages[{i}].content[{j}].image_url"
            try:
                if not vision:
                    raise ImageError("this model is text-only (it has no image processor): it cannot take an image")
                if m["role"] not in ("user", "tool"):
                    raise ImageError(f"images are taken in user and tool messages, not in a {m['role']} message")
                value = p.get("image_url")
                if not isinstance(value, dict) or not isinstance(value.get("url"), str):
                    raise ImageError('expected {"url": "data:image/...;base64,..."}')
                parts.append({"type": "image", "image": decode_image(value["url"]), "digest": image_digest(value["url"])})
            except ImageError as e:
                raise APIError(400, f"{where}: {e}"[:500], param=where, code="invalid_image") from None
        if out is messages:
            out = list(messages)
        out[i] = {**m, "content": parts}
    return out


def _lone_surrogate(value: Any, where: str = "body") -> str | None:
    """The path of the first string in a parsed body that holds a lone surrogate, else None."""
    todo = [(value, where)]
    while todo:
        v, path = todo.pop()
        if isinstance(v, str):
            if any("\ud800" <= c <= "\udfff" for c in v):
                return path
        elif isinstance(v, dict):
            todo += [(x, f"{path}.{k}" if path != "body" else str(k)) for k, x in v.items()]
            todo += [(k, path) for k in v if isinstance(k, str)]
        elif isinstance(v, list):
            todo += [(x, f"{path}[{i}]") for i, x in enumerate(v)]
    return None


def _is_json_object(s: str) -> bool:
    try:
        return isinstance(json.loads(s), dict)
    except ValueError:
        return False


def _tools(tools: Any) -> list[dict] | None:
    from hybridflow.agent.tools import validate_schema

    if tools is None:
        return None
    if not isinstance(tools, list) or len(tools) > 64:
        raise APIError(400, "tools must be a list of at most 64 function schemas", param="tools")
    for i, t in enumerate(tools):
        try:
            validate_schema(t, where=f"tools[{i}]")
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)[:300], param=f"tools[{i}]") from None
    return tools or None


def _tool_choice(choice: Any, tools: list[dict] | None) -> str:
    """"none" | "auto" | "required" | a named function (the model is not constrained: a named or
    required call is served as "auto", its text parsed for calls)."""
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice='required' needs tools", param="tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {type: function, function: {name}}", param="tool_choice")
    if name not in {t["function"]["name"] for t in tools or ()}:
        raise APIError(400, f"tool_choice names {name[:60]!r}, which is not among the request's tools", param="tool_choice")
    return "auto"
