"""The multi-turn agent loop (hybridflow/agent/loop.py): token in, token out; tool tokens masked;
trajectories in flight at once. No Ray: the backend is the HF rollout in this process (or, for the
timing test, a scripted one)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from hybridflow.agent.envs import EnvStep, Environment, register_env
from hybridflow.agent.format import message_delta_ids
from hybridflow.agent.loop import AgentSettings, run_trajectories, trajectory_metrics
from hybridflow.agent.tools import Tool, ToolResult, function_schema, register_tool
from hybridflow.protocol import Completion, SamplingParams
from test_agent_tools import LLAMA3_TEMPLATE


@register_env("test_again")
class AgainEnv(Environment):
    """Answers every model turn with "again (k)" and is done after three turns."""

    def reset(self, row):
        self.turns = 0
        return "start"

    def step(self, model_text):
        self.turns += 1
        return EnvStep(f"again ({self.turns})", 0.5, self.turns >= 3)


@register_tool("test_sleep")
class SleepTool(Tool):
    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema or function_schema("test_sleep", "sleeps", {"s": {"type": "number"}}, ["s"]))

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(float(parameters["s"]))
        return ToolResult("slept")


def _tokenizer(kind: str):
    from hybridflow.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    if kind == "llama":
        tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
        tok.chat_template = LLAMA3_TEMPLATE
    return tok


@pytest.mark.parametrize("kind", ["qwen", "llama"])
def test_model_tokens_are_the_sampled_tokens_and_tool_tokens_the_template_delta(tiny_model_dir, kind):
    """Every model token of every trajectory is a token the backend returned (same order, same
    log-prob), every request's prompt is the trajectory so far (nothing re-encoded), and every
    mask-0 run is the chat template's delta for the environment's message."""
    from transformers import AutoModelForCausalLM

    from hybridflow.rollout.hf_rollout import HFRollout

    tok = _tokenizer(kind)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    backend = HFRollout(model.eval(), tok, "cpu")
    calls = []

    def generate_fn(requests):
        out = backend.generate_requests(requests)
        calls.extend(zip(requests, out))
        return out

    # Half the vocabulary stops a turn, so a random model's turns are short and there are several.
    stops = tuple(range(40, 40 + len(tok) // 2))
    params = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=stops, seed=3)
    rows = [{"raw_prompt": [{"role": "user", "content": f"play {i}"}], "extra_info": {"env": "test_again"}} for i in range(4)]
    settings = AgentSettings(max_assistant_turns=5, response_budget=160)
    trajs, batcher = asyncio.run(run_trajectories(rows, generate_fn, tok, settings, params))

    assert max(t.num_turns for t in trajs) >= 2 and batcher.calls >= 2  # really multi-turn
    for t in trajs:
        covered = [0] * len(t.response_ids)
        for req, c in calls:
            k = len(req.prompt_ids) - len(t.prompt_ids)
            if k < 0 or list(req.prompt_ids) != t.prompt_ids + t.response_ids[:k]:
                continue  # another trajectory's request
            n = len(c.token_ids)
            assert t.response_ids[k:k + n] == list(c.token_ids) and t.response_mask[k:k + n] == [1] * n
            assert t.log_probs[k:k + n] == pytest.approx(list(c.log_probs), abs=0)
            covered[k:k + n] = [1] * n
        assert covered == t.response_mask  # every model token came from the backend, nothing else is masked in
        # the mask-0 runs: the template's delta of "again (1)", "again (2)", ...
        runs, j = [], 0
        while j < len(t.response_mask):
            if t.response_mask[j] == 0:
                start = j
                while j < len(t.response_mask) and t.response_mask[j] == 0:
                    j += 1
                runs.append(t.response_ids[start:j])
            else:
                j += 1
        want = [message_delta_ids(tok, [{"role": "user", "content": f"again ({i + 1})"}], after_eos=True) for i in range(len(runs))]
        assert runs == want
        assert t.reward == pytest.approx(0.5 * (len(runs) + (t.finish == "env_done")))


def _ppo_batch():
    """Two trajectories: model tokens (mask 1) around a tool reply (mask 0)."""
    from hybridflow.agent.loop import Trajectory
    from hybridflow.service.agent_rollout import trajectories_to_batch

    a = Trajectory(prompt_ids=[5, 6, 7])
    a.append([10, 11], model=True, log_probs=[-1.0, -2.0])
    a.append([20, 21, 22], model=False)
    a.append([12], model=True, log_probs=[-0.5])
    b = Trajectory(prompt_ids=[5, 6])
    b.append([13, 14, 15], model=True, log_probs=[-0.1, -0.2, -0.3])
    return trajectories_to_batch([a, b], pad_id=0, params=SamplingParams(max_new_tokens=8))


def test_shards_packed_by_managers_merge_into_the_batch_the_driver_packs_from_every_trajectory():
    """Rollout managers send their shards as tensors; the driver's merge must give the batch (and the
    agent/* metrics) that packing all trajectories in one place gives: rows back at their indices,
    prompts of different shards' widths left-padded again, versions only where a replica stamped them."""
    import pickle
    import random

    from hybridflow.agent.loop import Trajectory, trajectory_metrics
    from hybridflow.service.agent_rollout import AgentRollout, pack_trajectories, trajectories_to_batch

    rng = random.Random(0)
    trajs = []
    for i in range(11):
        t = Trajectory(prompt_ids=[rng.randrange(3, 50) for _ in range(rng.randrange(1, 9))], num_turns=rng.randrange(1, 4),
                       tool_calls=rng.randrange(3), reward=float(i % 3 == 0))
        for turn in range(t.num_turns):
            n = rng.randrange(1, 4)
            t.append([rng.randrange(3, 50) for _ in range(n)], model=True, log_probs=[-rng.random() for _ in range(n)],
                     versions=[7 + turn] * n if i % 4 else None)  # rows 0, 4, 8 carry no versions
            t.append([rng.randrange(3, 50)], model=False)
        trajs.append(t)
    R, params = 16, SamplingParams(max_new_tokens=16)
    shards = [list(range(0, 11, 3)), list(range(1, 11, 3)), list(range(2, 11, 3))]  # row i to manager i mod 3, as the managers shard
    agent = AgentRollout.__new__(AgentRollout)
    agent.tokenizer = type("Tok", (), {"pad_token_id": 1})()
    agent.settings = type("Settings", (), {"response_budget": R})()
    parts = [(rows, pickle.loads(pickle.dumps(pack_trajectories([trajs[j] for j in rows], 1, R))), None) for rows in shards]  # as sent
    assert len({p.prompts.shape[1] for _, p, _ in parts}) > 1  # the shards' prompt widths differ
    merged = agent.merge(parts, params, generate_calls=5, latencies=[0.1, 0.2])
    want = trajectories_to_batch(trajs, pad_id=1, params=params)
    assert set(merged.keys()) == set(want.keys()) | {"agent_reward"}
    for k in want.keys():
        assert torch.equal(merged[k], want[k]), k
    assert merged["agent_reward"].tolist() == [t.reward for t in trajs]
    assert merged.meta["metrics"] == pytest.approx(trajectory_metrics(trajs, generate_calls=5, latencies=[0.1, 0.2]))
    assert merged["rollout_policy_version"][0].tolist() == [-1] * R  # no stamps: -1, not a version


def test_tool_tokens_get_no_gradient_and_the_first_update_has_zero_kl():
    from hybridflow.algorithms import agg_loss, get_policy_loss, kl_loss

    batch = _ppo_batch()
    mask = batch["response_mask"].float()
    assert batch["response_mask"].tolist()[0] == [1, 1, 0, 0, 0, 1, 0, 0]
    assert batch["attention_mask"].tolist()[0][-8:] == [1, 1, 1, 1, 1, 1, 0, 0]  # attention sees the tool tokens
    old = batch["rollout_log_probs"]
    adv = torch.tensor([[1.0] * 8, [-1.0] * 8])
    ref = old - 0.3
    loss_fn = get_policy_loss("vanilla")

    def total(logp):
        pg, m = loss_fn(old, logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean")
        ent = agg_loss(-logp, mask, "token-mean")
        return pg + 0.01 * ent + 0.1 * kl_loss(logp, ref, mask, "low_var_kl", "token-mean"), m

    logp = old.clone().requires_grad_(True)
    loss, metrics = total(logp)
    loss.backward()
    assert float(metrics["ppo_kl"].detach()) == 0.0  # first update: the policy that sampled is the one trained
    assert (logp.grad[mask == 0] == 0).all() and (logp.grad[mask == 1] != 0).all()
    perturbed = old.clone()
    perturbed[mask == 0] += torch.randn(int((mask == 0).sum())) * 5  # change only the tool / padding tokens
    assert torch.equal(total(perturbed)[0], total(old)[0])


def _scripted(tok, answer):
    """A backend that writes answer(prompt text) (+ eos) for every request."""

    def generate_fn(requests):
        time.sleep(0.01)
        out = []
        for r in requests:
            ids = tok.encode(answer(tok.decode(list(r.prompt_ids))), add_special_tokens=False) + [tok.eos_token_id]
            out.append(Completion(tuple(ids), tuple([-0.1] * len(ids)), "stop"))
        return out

    return generate_fn


def test_a_slow_tool_delays_only_its_own_trajectory():
    tok = _tokenizer("qwen")
    tool = SleepTool()
    call = '<tool_call>{"name": "test_sleep", "arguments": {"s": 1.0}}</tool_call>'
    calls = []
    base = _scripted(tok, lambda prompt: "42" if "slept" in prompt else call if "slow" in prompt else "7")

    def generate_fn(requests):
        calls.append((time.monotonic(), len(requests)))
        return base(requests)

    rows = [{"raw_prompt": [{"role": "user", "content": "slow"}], "extra_info": {}}] + \
           [{"raw_prompt": [{"role": "user", "content": f"fast {i}"}], "extra_info": {}} for i in range(3)]
    trajs, batcher = asyncio.run(run_trajectories(rows, generate_fn, tok, AgentSettings(response_budget=400), SamplingParams(max_new_tokens=64),
                                                  tools=[tool]))
    slow, fast = trajs[0], trajs[1:]
    assert slow.tool_calls == 1 and slow.num_turns == 2 and slow.tool_seconds >= 1.0
    assert all(f.num_turns == 1 for f in fast)
    assert all(f.finished_at < slow.finished_at - 0.5 for f in fast)  # done while the tool still slept (1 s)
    assert calls[0][1] == 4  # the first turn of every trajectory went to the backend as one call
    m = trajectory_metrics(trajs, batcher)
    assert m["agent/num_turns/max"] == 2 and m["agent/tool_calls/mean"] == 0.25 and m["agent/tool_errors"] == 0
    assert m["agent/tool_seconds/mean"] >= 0.25


def test_a_backend_that_drops_completions_fails_its_requests_instead_of_hanging():
    """A backend returning fewer completions than requests: every waiting request gets the error (on
    b4554a1 the requests past the last completion waited forever)."""
    from hybridflow.agent.loop import RequestBatcher

    def short(requests):
        return [Completion((1,), (-0.1,), "stop")] * (len(requests) - 1)

    async def main():
        batcher = RequestBatcher(short, SamplingParams(max_new_tokens=4))
        calls = [batcher.generate([5, 6], 4, f"s{i}") for i in range(3)]
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=10)

    out = asyncio.run(main())
    assert [type(o) for o in out] == [RuntimeError] * 3 and "2 completions for 3 requests" in str(out[0])


def test_multi_turn_config_errors_name_the_key(tmp_path):
    from hybridflow.config import ConfigError, load_config, validate_config

    with pytest.raises(ConfigError, match=r"multi_turn.tool_config_path: file not found: /nope.yaml"):
        validate_config(load_config(None, ["actor_rollout_ref.model.path=x", "actor_rollout_ref.rollout.multi_turn.enable=true",
                                           "actor_rollout_ref.rollout.multi_turn.tool_config_path=/nope.yaml"]))
    tools = tmp_path / "tools.yaml"  # a typo in a sandbox limit: refused here, not as a tool error on every call
    tools.write_text("tools:\n  - class_name: python\n    config: {type: native, limits: {wal_s: 3}}\n")
    with pytest.raises(ConfigError, match=r"tool_config_path: .*PythonTool config: limits\.wal_s: not a sandbox limit .*"
                                          r"did you mean limits\.wall_s\?"):
        validate_config(load_config(None, ["actor_rollout_ref.model.path=x", "actor_rollout_ref.rollout.multi_turn.enable=true",
                                           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}"]))
    with pytest.raises(ConfigError, match=r"multi_turn.format must be one of \['hermes'\]"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.format=chatml"])


@register_env("test_stuck")
class StuckEnv(Environment):
    """An environment that talks to a server that never answers its second turn (no deadline of its own)."""

    def reset(self, row):
        self.turns = 0
        return "start"

    async def astep(self, model_text):
        self.turns += 1
        if self.turns >= 2:
            await asyncio.Event().wait()
        return EnvStep("go on", 0.0, False)


def test_a_tool_or_environment_without_a_deadline_of_its_own_stops_at_tool_timeout_s():
    """A tool call that never returns reads as an error to the model and its trajectory goes on; an
    environment that stops answering ends its trajectory; both counted (on b4554a1 each hung its batch
    until the trajectory's caller gave up: here, the test's own 10 s)."""
    tok = _tokenizer("qwen")
    call = '<tool_call>{"name": "test_sleep", "arguments": {"s": 3600}}</tool_call>'
    gen = _scripted(tok, lambda prompt: "42" if "tool_timeout_s" in prompt else call)
    settings = AgentSettings(response_budget=400, tool_timeout_s=0.3)
    rows = [{"raw_prompt": [{"role": "user", "content": "call"}], "extra_info": {}}]
    env_rows = [{"raw_prompt": [], "extra_info": {"env": "test_stuck"}}]

    async def main():
        tools = await asyncio.wait_for(run_trajectories(rows, gen, tok, settings, SamplingParams(max_new_tokens=64), tools=[SleepTool()]), 10)
        envs = await asyncio.wait_for(run_trajectories(env_rows, _scripted(tok, lambda prompt: "1"), tok, settings,
                                                       SamplingParams(max_new_tokens=64)), 10)
        return tools, envs

    (tool_trajs, batcher), (env_trajs, _) = asyncio.run(main())
    t = tool_trajs[0]
    assert t.tool_timeouts == 1 and t.tool_errors == 1 and t.num_turns == 2 and t.finish == "answer"  # it read the error, then answered
    assert "ran past multi_turn.tool_timeout_s=0.3" in tok.decode(t.response_ids)
    assert env_trajs[0].finish == "env_timeout" and env_trajs[0].tool_timeouts == 1 and env_trajs[0].num_turns == 2
    assert trajectory_metrics(tool_trajs + env_trajs, batcher)["agent/tool_timeouts"] == 2.0


def test_a_batcher_with_two_calls_in_flight_starts_the_next_before_the_first_returns():
    """max_in_flight=2 (a rollout manager's, over replicas that take requests while they generate): a
    turn that arrives while a call runs goes out at once in a call of its own instead of waiting for
    the slowest request of the running one. The backend below answers its first call only after a
    second call has started; with one call at a time that never happens."""
    from hybridflow.agent.loop import RequestBatcher

    async def main(max_in_flight: int) -> list[int]:
        second_started = asyncio.Event()
        order = []

        async def backend(requests):
            n = len(order)
            order.append(n)
            if n == 0:
                await asyncio.wait_for(second_started.wait(), 2)
            else:
                second_started.set()
            return [Completion((n,), (-0.1,), "stop") for _ in requests]

        batcher = RequestBatcher(backend, SamplingParams(max_new_tokens=4), max_in_flight=max_in_flight)
        first = asyncio.create_task(batcher.generate([1], 4, "a"))
        await asyncio.sleep(0.05)  # the first call is running
        second = await batcher.generate([2], 4, "b")
        return [(await first).token_ids[0], second.token_ids[0]]

    assert asyncio.run(main(2)) == [0, 1]  # the second call ran while the first waited for it
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(main(1))  # one at a time: the second request waits for the first call, which waits for it
