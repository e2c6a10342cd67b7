"""The OpenAI-compatible endpoint (agent/openai_server.py) and its token-in/token-out sessions
(agent/sessions.py), driven by the official `openai` client and by raw HTTP.

Oracles: the backend's own `generate_requests` for the same prompt ids and seed (tokens and
log-probs); for the session tests a scripted backend whose replies are fixed texts, so the expected
trajectory is written out by hand (the chat template's strings, tokenized independently)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.agent.loop import AgentSettings, RequestBatcher, run_trajectories
from hybridflow.agent.openai_agent import BlackBoxAgent
from hybridflow.agent.openai_server import EndpointSettings, LiveEndpoint
from hybridflow.protocol import Completion, Request, SamplingParams

CALC = {"type": "function", "function": {"name": "calculator", "description": "calc",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_backend(tiny_model_dir, tok):
    from hybridflow.rollout.hf_rollout import HFRollout

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return HFRollout(model, tok, "cpu")


class Scripted:
    """A backend that answers each request with the next of `texts` (tokenized, + eos): what the
    test writes is what the model 'sampled'; log-prob of token i is -0.01 * (i + 1)."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.requests = tok, texts if callable(texts) else list(texts), []  # texts: a list, or prompt text -> reply

    def __call__(self, requests):
        out = []
        for r in requests:
            self.requests.append(r)
            text = self.texts(self.tok.decode(list(r.prompt_ids))) if callable(self.texts) else self.texts.pop(0)
            ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            out.append(Completion(tuple(ids), tuple(-0.01 * (i + 1) for i in range(len(ids))), "stop"))
        return out


async def _until(cond, what: str, timeout_s: float = 10.0) -> None:
    """Wait until cond() holds (a test's ordering of requests in flight, without fixed sleeps)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.005)


async def _serve(tok, generate_fn, body, *, sampling="request", budget=200, max_prompt=1000, **settings):
    batcher = RequestBatcher(generate_fn, SamplingParams(max_new_tokens=budget, seed=1))
    ep = LiveEndpoint(EndpointSettings("tiny", budget, max_prompt, sampling=sampling, **settings), tok, batcher)
    async with ep.serve():
        return await body(ep, batcher)


def test_chat_tokens_and_logprobs_equal_generate_requests_for_the_same_seed(tok, hf_backend):
    base = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11)

    async def body(ep, batcher):
        s = ep.open_session()
        async with openai.AsyncOpenAI(base_url=ep.url(s), api_key=s.key, max_retries=0) as client:
            assert [m.id for m in (await client.models.list()).data] == ["tiny"]
            r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is 2*3?"}], tools=[CALC],
                                                     tool_choice="auto", logprobs=True, seed=11, max_tokens=24, temperature=1.0, n=2)
        return r, s

    r, session = asyncio.run(_serve(tok, hf_backend.generate_requests, body, max_prompt=1000))
    prompt = r.model_extra["prompt_token_ids"]
    oracle = hf_backend.generate_requests([Request(prompt, base)] * 2)  # the backend itself, the same prompt, seed and params
    for choice, want in zip(r.choices, oracle):
        assert choice.model_extra["token_ids"] == list(want.token_ids)
        assert [t.logprob for t in choice.logprobs.content] == list(want.log_probs)  # bit for bit
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in oracle)
    # what the session recorded for training: the first choice's tokens and log-probs as sampled
    traj = session.trajectory()
    assert traj.prompt_ids == prompt and traj.response_ids == list(oracle[0].token_ids) and traj.log_probs == list(oracle[0].log_probs)
    assert traj.response_mask == [1] * len(oracle[0].token_ids)


def test_top_logprobs_equal_an_independent_forward_pass(tok, hf_backend, tiny_model_dir):
    """top_logprobs=3 (chat) and logprobs=2 (completions) through the official client: each token's
    k most likely tokens and their log-probs equal a full forward pass of a separately loaded copy
    of the model over prompt + sampled tokens (temperature 0.7: log_softmax(logits / 0.7); KV-cached
    decode vs one full forward: atol 1e-4 in fp32); the sampled token's log-prob is its entry there."""
    base = SamplingParams(max_new_tokens=12, temperature=0.7, seed=5)

    async def body(ep, batcher):
        s = ep.open_session()
        async with openai.AsyncOpenAI(base_url=ep.url(s), api_key=s.key, max_retries=0) as client:
            chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is 2*3?"}],
                                                        logprobs=True, top_logprobs=3, max_tokens=12, temperature=0.7)
            s2 = ep.open_session()
        async with openai.AsyncOpenAI(base_url=ep.url(s2), api_key=s2.key, max_retries=0) as client:
            text = await client.completions.create(model="tiny", prompt="2*3=", logprobs=2, max_tokens=12, temperature=0.7)
        return chat, text

    chat, text = asyncio.run(_serve(tok, hf_backend.generate_requests, body, budget=12))
    oracle = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def full(prompt: list[int], toks: list[int]) -> torch.Tensor:  # [R, V]: log_softmax(logits / T) at each sampled position
        with torch.no_grad():
            logits = oracle(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1:-1].float() / base.temperature
        return torch.log_softmax(logits, -1)

    pieces = [tok.decode([i]) for i in range(len(tok))]
    ids = {p: i for i, p in enumerate(pieces) if pieces.count(p) == 1}  # (lone bytes all decode to U+FFFD: not named)

    def check(rows: list[list[tuple[str, float]]], want: torch.Tensor, k: int, keyed: bool = False) -> None:
        """Each listed token's log-prob is the oracle's for that token, and they are the k largest
        (compared as values: a near-tie may list two tokens in either order). keyed: the completions
        format's {token: log-prob} keeps one of the tokens that decode alike."""
        assert len(rows) == want.shape[0] >= 2
        for row, w in zip(rows, want):
            named = [(ids[t], lp) for t, lp in row if t in ids]
            assert torch.allclose(torch.tensor([lp for _, lp in named]), w[[i for i, _ in named]], atol=1e-4)
            top = w.topk(k).values
            if keyed:
                assert 1 <= len(row) <= k and all((top - lp).abs().min() < 1e-4 for _, lp in row)
            else:
                assert torch.allclose(torch.tensor([lp for _, lp in row]), top, atol=1e-4)

    choice = chat.choices[0]
    toks = choice.model_extra["token_ids"]
    want = full(chat.model_extra["prompt_token_ids"], toks)
    check([[(e.token, e.logprob) for e in c.top_logprobs] for c in choice.logprobs.content], want, 3)
    assert torch.allclose(torch.tensor([c.logprob for c in choice.logprobs.content]), want[range(len(toks)), toks], atol=1e-4)
    lp = text.choices[0].logprobs
    check([list(d.items()) for d in lp.top_logprobs], full(text.model_extra["prompt_token_ids"], text.choices[0].model_extra["token_ids"]), 2,
          keyed=True)


def _expected_delta(tok, messages_text: str) -> list[int]:
    """The tiny Qwen-style template written out: after the model's <|im_end|> the template adds "\n",
    then each message as <|im_start|>role\ncontent<|im_end|>\n and the next assistant header."""
    return tok.encode("\n" + messages_text + "<|im_start|>assistant\n", add_special_tokens=False)


@pytest.mark.parametrize("spelling, mismatches", [('{"name":"calculator","arguments":{"expression":"2*3"}}', 1),
                                                  ('{"name": "calculator", "arguments": {"expression": "2*3"}}', 0)])
def test_tool_calls_round_trip_and_the_recorded_tokens_win(tok, spelling, mismatches):
    """The model writes a call in its own JSON spelling; the client gets `tool_calls`, runs the tool and
    sends the history back, which the template re-renders in the canonical spelling. The trajectory
    keeps the sampled tokens (a re-rendering that differs is counted, never trained on)."""
    call_text = f"<tool_call>\n{spelling}\n</tool_call>"
    backend = Scripted(tok, [call_text, "The answer is 6."])

    async def body(ep, batcher):
        s = ep.open_session()
        async with openai.AsyncOpenAI(base_url=ep.url(s), api_key=s.key, max_retries=0) as client:
            messages = [{"role": "user", "content": "What is 2*3?"}]
            r1 = await client.chat.completions.create(model="tiny", messages=messages, tools=[CALC])
            m = r1.choices[0].message
            assert r1.choices[0].finish_reason == "tool_calls" and m.content is None
            assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("calculator", {"expression": "2*3"})]
            messages += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "6"}]
            r2 = await client.chat.completions.create(model="tiny", messages=messages, tools=[CALC])
            assert r2.choices[0].message.content == "The answer is 6." and r2.choices[0].finish_reason == "stop"
        return s

    s = asyncio.run(_serve(tok, backend, body))
    eos = [tok.eos_token_id]
    first = tok.encode(call_text, add_special_tokens=False) + eos
    tool = _expected_delta(tok, "<|im_start|>tool\n6<|im_end|>\n")
    second = tok.encode("The answer is 6.", add_special_tokens=False) + eos
    traj = s.trajectory()
    assert len(s.segments) == 1 and traj.num_turns == 2
    assert traj.response_ids == first + tool + second
    assert traj.response_mask == [1] * len(first) + [0] * len(tool) + [1] * len(second)
    assert traj.log_probs[: len(first)] == [-0.01 * (i + 1) for i in range(len(first))]
    assert traj.log_probs[len(first): len(first) + len(tool)] == [0.0] * len(tool)
    assert list(backend.requests[1].prompt_ids) == traj.prompt_ids + first + tool  # what the model was fed: the recorded tokens
    assert s.mismatches == mismatches


def test_a_rewritten_history_starts_a_new_segment_and_the_latest_is_trained(tok):
    backend = Scripted(tok, ["one", "two", "three"])

    async def body(ep, batcher):
        s = ep.open_session()
        async with openai.AsyncOpenAI(base_url=ep.url(s), api_key=s.key, max_retries=0) as client:
            h = [{"role": "user", "content": "a"}]
            r = await client.chat.completions.create(model="tiny", messages=h)
            h += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "b"}]
            await client.chat.completions.create(model="tiny", messages=h)  # extends: the same segment
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "summary: a, one, b"}])  # rewritten
        return s

    s = asyncio.run(_serve(tok, backend, body))
    assert len(s.segments) == 2 and s.segments[0].num_turns == 2 and s.dropped_segments == 1
    assert s.trajectory() is s.segments[1] and s.trajectory().response_ids == tok.encode("three", add_special_tokens=False) + [tok.eos_token_id]


def test_requests_in_flight_together_on_one_segment_keep_each_reply_after_its_own_prompt(tok):
    """Two /v1/completions requests in flight at once, the second's prompt extending the first's (an
    agent that does not wait): each reply must follow its own prompt, within the budget. On b4554a1
    both were placed on one segment, so the first reply sat after the second's prompt (a context it
    was not sampled in)."""
    import time

    replies = iter(["zero", "alpha", "beta"])

    def slow(requests):  # the first reply of each call takes a while: the next request arrives meanwhile
        time.sleep(0.3)
        return Scripted(tok, [next(replies) for _ in requests])(requests)

    def ids(text):
        return tok.encode(text, add_special_tokens=False)

    async def body(ep, batcher):
        s = ep.open_session()
        async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {s.key}"}) as http:
            async def complete(prompt):
                r = await http.post(f"{ep.url(s)}/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]

            p0 = ids("hello")
            r0 = await complete(p0)
            pa = p0 + r0 + ids(" more")
            pb = pa + ids(" and more")
            task_a = asyncio.create_task(complete(pa))
            await _until(lambda: s.requests_in_flight == 1, "request A placed")  # A is placed and generating
            rb = await complete(pb)
            ra = await task_a
        return s, [(p0, r0), (pa, ra), (pb, rb)]

    s, sent = asyncio.run(_serve(tok, slow, body, budget=40))
    tokens = [seg.prompt_ids + seg.response_ids for seg in s.segments]
    for prompt, reply in sent:
        assert any(t[: len(prompt) + len(reply)] == prompt + reply for t in tokens), (prompt, reply)
    assert all(len(seg.response_ids) <= 40 for seg in s.segments) and not s.in_flight


def test_per_session_limits_hold_and_an_ended_sessions_waiting_requests_are_dropped(tok):
    """Each session is bounded (actor_rollout_ref.rollout.agent.max_session_*): requests in flight,
    requests in all, segments, sampled tokens (each new segment no longer brings a whole new budget);
    and a request still waiting for the backend when its session ends (its agent timed out) is dropped
    with 410, never generated. On b4554a1 none of these limits existed and the dropped request ran."""
    import time

    seen = []

    def slow(requests):
        seen.extend(requests)
        time.sleep(0.3)
        return Scripted(tok, ["ok"] * len(requests))(requests)

    async def body(ep, batcher):
        s, busy_session, ended = ep.open_session(), ep.open_session(), ep.open_session()
        out = {}

        def post(session, messages, **kw):
            return http.post(f"{ep.url(session)}/chat/completions", headers={"Authorization": f"Bearer {session.key}"},
                             json={"model": "tiny", "messages": messages, **kw})

        def user(text):
            return [{"role": "user", "content": text}]

        async with httpx.AsyncClient(timeout=30) as http:
            first = asyncio.create_task(post(s, user("a")))
            await _until(lambda: s.requests_in_flight == 1, "the first request placed")
            out["a second request while the first runs"] = (await post(s, user("b"))).status_code  # concurrency 1
            reply = (await first).json()["choices"][0]["message"]["content"]
            out["a second conversation"] = (await post(s, user("c"))).status_code
            out["a third conversation"] = (await post(s, user("x"))).status_code  # segments: 2
            more = user("a") + [{"role": "assistant", "content": reply}] + user("d")
            out["max_tokens past the session's tokens"] = (await post(s, more, max_tokens=5)).status_code  # 8 - 6 sampled
            out["within them"] = (await post(s, more, max_tokens=1)).status_code
            out["a fourth request"] = (await post(s, more, max_tokens=1)).status_code  # requests: 3
            busy = asyncio.create_task(post(busy_session, user("f")))  # occupies the backend ...
            calls = len(seen)
            await _until(lambda: len(seen) > calls, "the busy request in the backend")
            waiting = asyncio.create_task(post(ended, user("never")))
            await _until(lambda: any(entry[2] == ended.id for entry in batcher.pending),
                         "the ended session's request waiting in the batcher")  # ... so it waits when its session ends
            ep.close_session(ended)
            out["a waiting request of a session that ended"] = (await waiting).status_code
            await busy
        return out, s

    out, s = asyncio.run(_serve(tok, slow, body, max_session_concurrency=1, max_session_requests=3, max_session_segments=2,
                                max_session_tokens=8))
    assert out == {"a second request while the first runs": 429, "a second conversation": 200, "a third conversation": 400,
                   "max_tokens past the session's tokens": 400, "within them": 200, "a fourth request": 429,
                   "a waiting request of a session that ended": 410}, out
    assert not any(tok.decode(list(r.prompt_ids)).endswith("never<|im_end|>\n<|im_start|>assistant\n") for r in seen)
    assert s.sampled <= 8 and s.reserved == 0


def _hostile(url: str, key: str, other_key: str, other_url: str, big: bytes) -> list[tuple[str, str, dict, object, int]]:
    """(name, method, headers, body, expected status): what a policy-written or broken client may send."""
    ok = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    msgs = [{"role": "user", "content": "hi"}]

    def chat(**fields):
        return {"model": "tiny", "messages": msgs, **fields}

    return [
        ("broken json", "POST", ok, b'{"model": "tiny", "messages": [', 400),
        ("not an object", "POST", ok, b"[1, 2]", 400),
        ("not utf-8", "POST", ok, b"\xff\xfe{", 400),
        ("10 MB body", "POST", ok, big, 413),
        ("chunked body over the limit", "POST", ok, "chunked", 413),  # no Content-Length: counted as it streams in
        ("no key", "POST", {"Content-Type": "application/json"}, chat(), 401),
        ("wrong key", "POST", {**ok, "Authorization": "Bearer hf-wrong"}, chat(), 401),
        ("another session's key", "POST", {**ok, "Authorization": f"Bearer {other_key}"}, chat(), 403),
        ("not bearer", "POST", {**ok, "Authorization": f"Basic {key}"}, chat(), 401),
        ("unknown model", "POST", ok, {"model": "gpt-4o", "messages": msgs}, 404),
        ("no model", "POST", ok, {"messages": msgs}, 404),
        ("no messages", "POST", ok, {"model": "tiny"}, 400),
        ("empty messages", "POST", ok, chat(messages=[]), 400),
        ("bad role", "POST", ok, chat(messages=[{"role": "root", "content": "x"}]), 400),
        ("content not text", "POST", ok, chat(messages=[{"role": "user", "content": {"$gt": 1}}]), 400),
        ("too many messages", "POST", ok, chat(messages=msgs * 300), 400),
        ("negative max_tokens", "POST", ok, chat(max_tokens=-5), 400),
        ("huge max_tokens", "POST", ok, chat(max_tokens=10**9), 400),
        ("string max_tokens", "POST", ok, chat(max_completion_tokens="9"), 400),
        ("n too large", "POST", ok, chat(n=1000), 400),
        ("temperature out of range", "POST", ok, chat(temperature=-1), 400),
        ("top_p zero", "POST", ok, chat(top_p=0), 400),
        ("seed not int", "POST", ok, chat(seed="x"), 400),
        ("too many stops", "POST", ok, chat(stop=["a", "b", "c", "d", "e"]), 400),
        ("stream", "POST", ok, chat(stream=True), 400),
        ("too many top_logprobs", "POST", ok, chat(logprobs=True, top_logprobs=21), 400),
        ("top_logprobs without logprobs", "POST", ok, chat(top_logprobs=2), 400),
        ("unknown tool choice", "POST", ok, chat(tools=[CALC], tool_choice={"type": "function", "function": {"name": "rm_rf"}}), 400),
        ("malformed tool schema", "POST", ok, chat(tools=[{"type": "function", "function": {"name": 5}}]), 400),
        ("assistant tool call not json", "POST", ok,
         chat(messages=msgs + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                                       "function": {"name": "calculator", "arguments": "{oops"}}]}]), 400),
        ("20,000 levels of nesting", "POST", ok, b'{"model": "tiny", "messages": ' + b"[" * 20000 + b"]" * 20000 + b"}", 400),
        ("a lone surrogate", "POST", ok, chat(messages=[{"role": "user", "content": "hi \ud800"}]), 400),
        ("response_format json schema", "POST", ok, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400),
        ("echo", "POST", ok, {"model": "tiny", "prompt": "hi", "echo": True}, 400),  # sent to /completions (below)
        ("unknown session", "POST", ok, chat(), 404),  # sent to a made-up session id (below)
        ("unknown route", "POST", ok, chat(), 404),
    ]


def test_hostile_requests_get_their_status_and_change_nothing(tok):
    backend = Scripted(tok, ["fine"])

    async def body(ep, batcher):
        s, other = ep.open_session(), ep.open_session()
        url = ep.url(s)
        cases = _hostile(url, s.key, other.key, ep.url(other), b'{"model": "tiny", "messages": [' + b"x" * (10 << 20) + b"]}")
        assert len(cases) == 36
        got = []
        async with httpx.AsyncClient(timeout=30) as http:
            for name, method, headers, payload, want in cases:
                target = {"unknown session": f"{ep.base_url}/sessions/{'0' * 32}/v1/chat/completions",
                          "unknown route": f"{url}/admin/weights", "echo": f"{url}/completions"}.get(name, f"{url}/chat/completions")
                if payload == "chunked":
                    async def chunks():
                        for _ in range(4):
                            yield b"x" * (512 << 10)
                    content = chunks()
                else:
                    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                r = await http.request(method, target, headers=headers, content=content)
                err = r.json()["error"]
                got.append((name, r.status_code, want))
                assert set(err) == {"message", "type", "param", "code"} and err["message"], (name, err)
            state = (len(s.segments), s.requests, len(other.segments), batcher.calls)
            async with openai.AsyncOpenAI(base_url=url, api_key=s.key, max_retries=0) as client:  # the session still serves
                r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        return got, state, r

    got, state, r = asyncio.run(_serve(tok, backend, body))
    assert [(n, g) for n, g, w in got if g != w] == [], got
    assert state == (0, 0, 0, 0)  # nothing recorded, nothing generated by any of them
    assert r.choices[0].message.content == "fine" and len(backend.requests) == 1


def test_max_tokens_is_bounded_by_the_trajectory_budget(tok):
    backend = Scripted(tok, ["ab"])

    async def body(ep, batcher):
        s = ep.open_session()
        async with openai.AsyncOpenAI(base_url=ep.url(s), api_key=s.key, max_retries=0) as client:
            with pytest.raises(openai.BadRequestError, match="remaining token budget"):
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=9)
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        return backend.requests

    (req,) = asyncio.run(_serve(tok, backend, body, budget=8))
    assert req.params.max_new_tokens == 8  # no max_tokens: the budget left


def test_training_sampling_is_the_runs_and_overrides_are_counted(tok):
    backend = Scripted(tok, ["a"])

    async def body(ep, batcher):
        s = ep.open_session()
        async with openai.AsyncOpenAI(base_url=ep.url(s), api_key=s.key, max_retries=0) as client:
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=0.3, top_p=0.5)
        return ep.counters.sampling_overridden, s.sampling_overridden

    assert asyncio.run(_serve(tok, backend, body, sampling="run")) == (1, 1)
    assert backend.requests[0].params.temperature == 1.0 and backend.requests[0].params.top_p == 1.0


async def _agent_ok(client, row):
    r = await client.chat.completions.create(model=row["model"], messages=row["messages"])
    return {"reward": float(r.choices[0].message.content == "yes"), "note": "dicts are fine"}


async def _agent_raises(client, row):
    await client.chat.completions.create(model=row["model"], messages=row["messages"])
    raise RuntimeError("agent bug")


async def _agent_hangs(client, row):
    await asyncio.sleep(60)


@pytest.mark.parametrize("fn, reward, error, timeout", [("_agent_ok", 1.0, False, False), ("_agent_raises", 0.0, True, False),
                                                        ("_agent_hangs", 0.0, True, True)])
def test_openai_agent_function_trajectories(tok, fn, reward, error, timeout):
    """`openai_agent` runs the user's function per row; its session's tokens are the trajectory; an
    agent that raises or hangs scores 0, is counted, and stops nothing else."""
    from hybridflow.agent.loop import trajectory_metrics

    backend = Scripted(tok, ["yes", "yes"])
    settings = AgentSettings(response_budget=64, black_box=BlackBoxAgent(function=f"{__name__}:{fn}", timeout_s=1.0),
                             endpoint=EndpointSettings("tiny", 64, 200))
    rows = [{"raw_prompt": [{"role": "user", "content": "ok?"}], "extra_info": {}}] * 2
    trajs, batcher = asyncio.run(run_trajectories(rows, backend, tok, settings, SamplingParams(max_new_tokens=64)))
    yes = tok.encode("yes", add_special_tokens=False) + [tok.eos_token_id]
    for t in trajs:
        assert t.reward == reward and bool(t.agent_error) == error and t.agent_timeout == timeout
        assert t.response_ids == (yes if fn != "_agent_hangs" else [])
    m = trajectory_metrics(trajs, batcher)
    assert m["agent/agent_errors"] == 2 * error and m["agent/agent_timeouts"] == 2 * timeout


@pytest.mark.parametrize("sandbox", [False, True], ids=["process", "sandboxed"])
def test_openai_agent_command_plays_in_its_own_process(tok, sandbox):
    """`agent.command`: examples/openai_agent/agent.py as an unmodified program (OPENAI_BASE_URL /
    OPENAI_API_KEY from its environment, the row on stdin, the reward on stdout), as a plain process
    and in the OS sandbox (through the bridge and the endpoint's Unix socket). The scripted model
    calls the calculator with 12*34, then answers with its result: right for 12*34, wrong for 12*35."""
    import os
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "openai_agent", "agent.py")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    backend = Scripted(tok, lambda prompt: "The answer is 408." if prompt.endswith("408<|im_end|>\n<|im_start|>assistant\n") else call)
    settings = AgentSettings(response_budget=256, black_box=BlackBoxAgent(command=f"{sys.executable} {script}", timeout_s=60, sandbox=sandbox),
                             endpoint=EndpointSettings("tiny", 256, 1000, unix_socket=sandbox))
    rows = [{"raw_prompt": [{"role": "user", "content": f"What is 12*{b}?"}], "extra_info": {}} for b in (34, 35)]
    trajs, _ = asyncio.run(run_trajectories(rows, backend, tok, settings, SamplingParams(max_new_tokens=256)))
    assert sorted(t.reward for t in trajs) == [0.0, 1.0] and not any(t.agent_error for t in trajs)
    for t in trajs:  # call, the tool's answer (mask 0), the final answer
        assert t.num_turns == 2 and t.tool_calls == 1 and 0 in t.response_mask and t.retokenization_mismatch == 0


HOSTILE_AGENT = r'''
import json, os, socket, sys, urllib.error, urllib.request

row = json.load(sys.stdin)
info = row["extra_info"]
checks = {}
checks["sees the project"] = os.path.exists(info["project"])
try:
    socket.create_connection(("127.0.0.1", info["host_port"]), timeout=2).close()
    checks["reaches a host service on 127.0.0.1"] = True
except OSError:
    checks["reaches a host service on 127.0.0.1"] = False
try:
    open(os.path.abspath(__file__), "a").close()
    checks["writes its own script"] = True
except OSError:
    checks["writes its own script"] = False
try:  # its script's directory: the host's checks nothing lands there (inside, it may be the sandbox's own /tmp)
    open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "planted"), "w").close()
except OSError:
    pass
checks["sees the host's environment"] = "HYBRIDFLOW_TEST_SECRET" in os.environ
checks["sees a file next to its script"] = os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "answers.txt"))


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                                                  "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, None


base = os.environ["OPENAI_BASE_URL"]
body = {"model": os.environ["OPENAI_MODEL"], "messages": row["messages"]}
own = base.split("/sessions/")[1].split("/")[0]
checks["serves another session's id"] = post(base.replace(own, "0" * 32) + "/chat/completions", body)[0] not in (401, 403, 404)
status, reply = post(base + "/chat/completions", body)
served = status == 200 and reply["choices"][0]["message"]["content"] == "yes"
# One number: 1 when served and contained; each breach adds its bit (the test names them).
print(json.dumps({"reward": float(served) + sum(2 ** (i + 1) for i, v in enumerate(checks.values()) if v)}))
'''
BREACHES = ["sees the project", "reaches a host service on 127.0.0.1", "writes its own script", "sees the host's environment",
            "sees a file next to its script", "serves another session's id"]


@pytest.mark.parametrize("python", ["venv", "system"])
def test_sandboxed_agent_command_reaches_its_session_and_nothing_else(tok, python, monkeypatch):
    """agent.sandbox=true: a hostile command (stdlib only) looks for the project, a service on the
    host's 127.0.0.1, a writable script, the host's environment, a file next to its script and another
    session, and plants a file next to its script; it reaches only its own session, through the bridge,
    and nothing lands on the host. The venv's interpreter (its base lives under /root, which `nobody`
    cannot read) runs on the unshare backend; the system's on bwrap."""
    import os
    import shutil
    import socket
    import sys
    import tempfile

    from hybridflow.agent.openai_agent import agent_sandbox

    interpreter = sys.executable if python == "venv" else "/usr/bin/python3"
    if not os.access(interpreter, os.X_OK):
        pytest.skip("no /usr/bin/python3")
    # Not pytest's tmp_path (its parents are 0700). Under the host's /tmp for the system Python (bwrap
    # binds it on top of the sandbox's own /tmp), under /var/tmp for the venv's.
    folder = tempfile.mkdtemp(prefix="hostile-agent-", dir="/tmp" if python == "system" else "/var/tmp")
    os.chmod(folder, 0o755)
    script = os.path.join(folder, "agent.py")
    with open(script, "w") as f:
        f.write(HOSTILE_AGENT)
    with open(os.path.join(folder, "answers.txt"), "w") as f:  # what a command run next to it must not see
        f.write("42")
    monkeypatch.setenv("HYBRIDFLOW_TEST_SECRET", "1")
    host_service = socket.create_server(("127.0.0.1", 0))
    try:
        command = f"{interpreter} {script}"
        if python == "system" and shutil.which("bwrap"):
            assert agent_sandbox(command)[0].backend == "bwrap"
        backend = Scripted(tok, ["yes"])
        settings = AgentSettings(response_budget=64, black_box=BlackBoxAgent(command=command, timeout_s=60, sandbox=True),
                                 endpoint=EndpointSettings("tiny", 64, 200, unix_socket=True))
        project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        rows = [{"raw_prompt": [{"role": "user", "content": "ok?"}],
                 "extra_info": {"project": os.path.join(project, "pyproject.toml"), "host_port": host_service.getsockname()[1]}}]
        (t,), _ = asyncio.run(run_trajectories(rows, backend, tok, settings, SamplingParams(max_new_tokens=64)))
        planted = sorted(os.listdir(folder))
    finally:
        host_service.close()
        shutil.rmtree(folder)
    assert planted == ["agent.py", "answers.txt"]  # nothing written next to its script on the host
    assert not t.agent_error, t.agent_error
    breached = [name for i, name in enumerate(BREACHES) if int(t.reward) >> (i + 1) & 1]
    assert t.reward == 1.0 and not breached, breached
    assert t.response_ids == tok.encode("yes", add_special_tokens=False) + [tok.eos_token_id]


YES_AGENT = r'''
import json, os, sys, urllib.request

row = json.load(sys.stdin)
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                             json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": row["messages"]}).encode(),
                             {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    print(json.dumps({"reward": float(json.load(r)["choices"][0]["message"]["content"] == "yes")}))
'''


def test_more_sandboxed_agents_in_flight_than_executor_threads_all_finish(tok):
    """Each sandboxed agent's run blocks a thread until its program ends, and its program waits for
    a reply that the batcher's generate call (another thread) must produce. With the loop's default
    executor at 2 threads and 5 agents in flight, b4554a1 deadlocked (every thread an agent waiting;
    each timed out at agent.timeout_s, reward 0); each blocking call now has a thread of its own."""
    import concurrent.futures
    import os
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="yes-agent-", dir="/var/tmp")
    os.chmod(folder, 0o755)
    script = os.path.join(folder, "agent.py")
    with open(script, "w") as f:
        f.write(YES_AGENT)
    settings = AgentSettings(response_budget=64, black_box=BlackBoxAgent(command=f"/usr/bin/python3 {script}", timeout_s=30, sandbox=True),
                             endpoint=EndpointSettings("tiny", 64, 200, unix_socket=True))
    rows = [{"raw_prompt": [{"role": "user", "content": "ok?"}], "extra_info": {}} for _ in range(5)]

    async def main():
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(2))
        return await run_trajectories(rows, Scripted(tok, lambda prompt: "yes"), tok, settings, SamplingParams(max_new_tokens=64))

    try:
        trajs, _ = asyncio.run(main())
    finally:
        shutil.rmtree(folder)
    assert [(t.reward, bool(t.agent_timeout), t.agent_error) for t in trajs] == [(1.0, False, "")] * 5


def test_a_fixed_agent_port_with_async_rollout_is_refused_naming_the_key():
    """With the agent loops on the driver, each batch in flight and validation serve an endpoint of their
    own: with a fixed port all but one failed with EADDRINUSE mid-run on b4554a1 (accepted at start); now
    refused before any worker starts. On rollout managers each serves one endpoint for the whole run."""
    from hybridflow.config import ConfigError, load_config, validate_config

    base = ["actor_rollout_ref.model.path=x", "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.agent.function={__file__}:_agent_ok", "actor_rollout_ref.rollout.agent.port=8765"]
    pools = ["trainer.async_rollout=true", "resource_pool.pools.actor_pool.workers_per_node=2",
             "resource_pool.pools.rollout_pool.workers_per_node=1", "resource_pool.mapping.actor_rollout=actor_pool",
             "resource_pool.mapping.rollout=rollout_pool"]
    with pytest.raises(ConfigError, match=r"agent\.port=8765 with trainer\.async_rollout=true: .* set actor_rollout_ref\.rollout\.agent\.port=0"):
        validate_config(load_config(None, [*base, *pools, "actor_rollout_ref.rollout.agent.num_workers=0"]))
    for accepted in ([*base, *pools], base):  # on rollout managers (the default here) manager i listens on port + i for the whole run;
        try:  # the colocated rollout serves one endpoint at a time: a fixed port is fine there too
            validate_config(load_config(None, accepted))
        except ConfigError as e:
            assert "agent.port" not in str(e)


def test_agent_sandbox_config_errors_name_the_key():
    """agent.sandbox=true is for a command: with a function it is refused before any worker starts,
    naming the key; so are sandbox_paths that are not absolute existing paths, or set without the sandbox."""
    import os
    import sys

    from hybridflow.config import ConfigError, load_config, validate_config

    base = ["actor_rollout_ref.model.path=x", "actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.agent.sandbox=true"]
    with pytest.raises(ConfigError, match=r"agent\.sandbox=true applies to actor_rollout_ref\.rollout\.agent\.command"):
        validate_config(load_config(None, [*base, f"actor_rollout_ref.rollout.agent.function={__file__}:_agent_ok"]))
    # sandbox_paths: absolute, existing paths, for a sandboxed command; each wrong one is named with the key
    command = f"actor_rollout_ref.rollout.agent.command={sys.executable} {__file__}"
    with pytest.raises(ConfigError) as e:
        validate_config(load_config(None, [*base, command, "actor_rollout_ref.rollout.agent.sandbox_paths=[relative/dir,/nonexistent-hf-path]"]))
    assert "agent.sandbox_paths: 'relative/dir' is not an absolute path that exists" in str(e.value)
    assert "agent.sandbox_paths: '/nonexistent-hf-path' is not an absolute path that exists" in str(e.value)
    with pytest.raises(ConfigError, match=r"agent\.sandbox_paths is set but actor_rollout_ref\.rollout\.agent\.sandbox is not"):
        validate_config(load_config(None, [base[0], base[1], command, f"actor_rollout_ref.rollout.agent.sandbox_paths=[{os.path.dirname(__file__)}]"]))
