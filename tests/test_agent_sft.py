"""Multi-turn SFT (hybridflow/agent/sft_data.py) teaches the very tokens the agent loop samples and
appends, and the tool demo's task data is what its recipe claims."""

from __future__ import annotations

import asyncio
import json

import pytest

from hybridflow.agent.format import get_format
from hybridflow.agent.loop import AgentSettings, run_trajectories
from hybridflow.agent.sft_data import MultiTurnSFTDataset
from hybridflow.agent.tools import load_tool_config
from hybridflow.data.dataset import DataError
from hybridflow.data.tasks import CALCULATOR_SCHEMA, make_multiply_task, write_parquet
from hybridflow.protocol import Completion, SamplingParams
from test_agent_loop import _tokenizer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
CONVERSATION = [{"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"}]


@pytest.fixture(scope="module")
def tool_config(tmp_path_factory):
    return make_multiply_task(tmp_path_factory.mktemp("multiply"), n_train=200, n_val=50, n_sft=400)


def _tok(kind: str):
    """The test templates, plus the tiny model's compact tool template (it renders tools= itself)."""
    from hybridflow.models.tiny import TOOLS_CHAT_TEMPLATE

    tok = _tokenizer("qwen" if kind == "tools" else kind)
    if kind == "tools":
        tok.chat_template = TOOLS_CHAT_TEMPLATE
    return tok


@pytest.mark.parametrize("kind", ["qwen", "llama", "tools"])
def test_sft_tokens_equal_the_agent_loop_trajectory(tmp_path, tool_config, kind):
    """The SFT row's ids are the trajectory the loop builds when the backend writes the demo's
    assistant turns; the loss mask is the trajectory's response mask (0 on the prompt)."""
    tok = _tok(kind)
    path = write_parquet([{"messages": CONVERSATION, "tools": json.dumps([CALCULATOR_SCHEMA])}], tmp_path / "sft.parquet")
    ids, mask = MultiTurnSFTDataset([path], tok, 2048).samples[0]

    turns = iter(m["content"] for m in CONVERSATION if m["role"] == "assistant")

    def generate_fn(requests):
        out = []
        for _ in requests:
            t = tok.encode(next(turns), add_special_tokens=False) + [tok.eos_token_id]
            out.append(Completion(tuple(t), tuple([0.0] * len(t)), "stop"))
        return out

    tools = load_tool_config(tool_config["tool_config"])
    row = {"raw_prompt": CONVERSATION[:1], "extra_info": {}}
    [traj], _ = asyncio.run(run_trajectories([row], generate_fn, tok, AgentSettings(response_budget=512), SamplingParams(max_new_tokens=512), tools))
    assert traj.tool_calls == 1 and traj.tool_errors == 0 and traj.finish == "answer"
    assert ids == traj.prompt_ids + traj.response_ids
    assert mask == [0] * len(traj.prompt_ids) + traj.response_mask


@pytest.mark.parametrize("kind", ["qwen", "tools"])
def test_sft_tokens_are_the_rendered_conversation(tmp_path, kind):
    """Oracle independent of the delta logic: the tiny templates are append-only, so the SFT ids are a
    prefix of the whole conversation rendered at once (the tool prompt in a system message, or the
    template's own tool block)."""
    from hybridflow.agent.format import get_format

    tok = _tok(kind)
    path = write_parquet([{"messages": CONVERSATION, "tools": json.dumps([CALCULATOR_SCHEMA])}], tmp_path / "sft.parquet")
    ids, mask = MultiTurnSFTDataset([path], tok, 2048).samples[0]
    if kind == "tools":
        whole = tok.apply_chat_template(CONVERSATION, tools=[CALCULATOR_SCHEMA], tokenize=False)
        assert whole.startswith("<|im_start|>system\nTools: calculator(expression).")
    else:
        system = {"role": "system", "content": get_format("hermes").system_prompt([CALCULATOR_SCHEMA])}
        whole = tok.apply_chat_template([system, *CONVERSATION], tokenize=False)
    assert tok.decode(ids) == whole[: len(tok.decode(ids))] and whole.endswith(tok.decode(ids) + "\n")
    learned = tok.decode([t for t, m in zip(ids, mask) if m])
    assert learned == CALL + "<|im_end|>" + "408<|im_end|>"


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "row 0: column 'messages' has roles ['user']"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "has roles ['assistant']"),
    ({"messages": CONVERSATION, "tools": "{not json"}, "row 0: column 'tools' is a string that is not JSON"),
    ({"messages": CONVERSATION, "tools": json.dumps({"name": "x"})}, "column 'tools' must be a list of OpenAI function schemas"),
])
def test_bad_multi_turn_rows_name_file_and_row(tmp_path, row, message):
    path = write_parquet([row], tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="bad.parquet") as e:
        MultiTurnSFTDataset([path], _tokenizer("qwen"), 2048)
    assert message in str(e.value)


def test_multiply_task_holds_out_val_and_demonstrates_mostly_wrong_behaviour(tool_config):
    import pyarrow.parquet as pq

    train = pq.read_table(tool_config["train"]).to_pylist()
    val = pq.read_table(tool_config["val"]).to_pylist()
    sft = pq.read_table(tool_config["sft"]).to_pylist()
    pair = lambda r: (r["extra_info"]["a"], r["extra_info"]["b"])  # noqa: E731
    assert not {pair(r) for r in train} & {pair(r) for r in val}
    assert all(int(r["reward_model"]["ground_truth"]) == r["extra_info"]["a"] * r["extra_info"]["b"] for r in train + val)
    val_prompts = {r["prompt"][0]["content"] for r in val}
    assert not any(r["messages"][0]["content"] in val_prompts for r in sft)
    assert all(int(r["reward_model"]["ground_truth"]) >= 100_000 for r in train + val)  # 6 digits: fixed copy offsets
    def tally(rows) -> tuple[int, int]:  # (answered in the head, right)
        right = direct = 0
        for r in rows:
            a, b = map(int, r["messages"][0]["content"][len("What is "):-1].split("*"))
            answer = int(r["messages"][-1]["content"][len("The answer is "):-1])
            direct += len(r["messages"]) == 2
            right += answer == a * b
            if len(r["messages"]) == 4:  # the call is exact or rounds b to tens; the answer copies the tool's result
                (call,) = get_format("hermes").parse(r["messages"][1]["content"]).calls
                assert call.arguments["expression"] in (f"{a}*{b}", f"{a}*{b // 10 * 10}")
                assert r["messages"][3]["content"] == f"The answer is {r['messages'][2]['content']}."
        return direct, right

    # defaults: 60% answer in the head (never right), every call exact: right = 0.4; bounds ~3 sigma for 400 rows
    direct, right = tally(sft)
    assert 0.52 < direct / len(sft) < 0.68 and right == len(sft) - direct
    # the copy stage's conversations: every one calls the tool with the exact operands and copies its result
    copy = pq.read_table(tool_config["sft_copy"]).to_pylist()
    assert len(copy) == len(sft) and tally(copy) == (0, len(copy))
    assert not any(r["messages"][0]["content"] in val_prompts for r in copy)


def test_guess_task_conversations_are_games_played_against_the_environment(tmp_path):
    """Every SFT game ends on the right guess, its replies are what the registered environment says
    to those guesses, and counting up is the majority strategy."""
    import pyarrow.parquet as pq

    from hybridflow.agent.envs import make_env_for_row
    from hybridflow.agent.tasks import make_guess_task

    files = make_guess_task(tmp_path, n_train=64, n_sft=200)
    train = pq.read_table(files["train"]).to_pylist()
    val = pq.read_table(files["val"]).to_pylist()
    assert sorted({r["extra_info"]["target"] for r in val}) == list(range(1, 11))
    assert len({r["prompt"][0]["content"] for r in train}) == 1  # one prompt; the target lives in extra_info
    scans = 0
    for r in pq.read_table(files["sft"]).to_pylist():
        msgs = r["messages"]
        guesses = [int(m["content"]) for m in msgs if m["role"] == "assistant"]
        replies = [m["content"] for m in msgs if m["role"] == "user"][1:]
        scans += guesses[:2] == [1, 2] or guesses == [1]
        row = {**train[0], "extra_info": {**train[0]["extra_info"], "target": guesses[-1]}}
        env = make_env_for_row(row)
        env.reset(row)
        assert [env.step(str(g)).message for g in guesses[:-1]] == replies
        assert env.step(str(guesses[-1])).done and env.done
    assert 0.6 < scans / 200 < 0.8
