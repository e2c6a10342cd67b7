"""Environments from the ecosystem through env_agent (agent/ecosystem.py): a verifiers taskset whose
rubric is the reward, and an OpenEnv server driven over openenv's own client. The model is
scripted (fixed replies), so each trajectory's reward is known independently: the taskset's
reward written out (vf_arith.expected_reward), the OpenEnv game's rule."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from hybridflow.agent.loop import AgentSettings, run_trajectories
from hybridflow.protocol import SamplingParams
from test_openai_endpoint import Scripted  # a backend answering each request with a fixed reply of its prompt


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_verifiers_taskset_rows_are_scored_by_its_rubric(tok, tmp_path):
    import pandas as pd

    from hybridflow.utils.prepare import main_prepare
    from vf_arith import ROWS, expected_reward

    out = tmp_path / "vf.parquet"
    assert main_prepare(["--verifiers", "vf_arith", "-o", str(out)]) == 0
    rows = pd.read_parquet(out).to_dict("records")
    assert [r["prompt"][-1]["content"] for r in rows] == [f"{q}=" for q, _ in ROWS] and rows[0]["prompt"][0]["role"] == "system"
    replies = {"2+3=": "5", "4+4=": "it is 8", "1+6=": "6"}
    agent_rows = [{"raw_prompt": list(r["prompt"]), "extra_info": r["extra_info"]} for r in rows]
    trajs, _ = asyncio.run(run_trajectories(agent_rows, Scripted(tok, lambda p: next(v for k, v in replies.items() if k in p)), tok,
                                            AgentSettings(response_budget=32), SamplingParams(max_new_tokens=32)))
    want = [expected_reward(i, replies[f"{q}="]) for i, (q, _) in enumerate(ROWS)]
    assert [t.reward for t in trajs] == want and want == [1.25, 1.0 + 0.5 / 8, 0.25]
    assert all(t.finish == "env_done" and t.num_turns == 1 for t in trajs)


def test_openenv_server_played_over_its_client(tok):
    from openenv_guess import serve

    url, stop = serve()
    try:
        rows = [{"raw_prompt": [], "extra_info": {"env": "openenv", "env_kwargs": {"url": url, "message_key": "prompt",
                                                                                    "reset_kwargs": {"target": t}}}} for t in (3, 9)]
        # the model guesses 3, then (after "No.") 9: the first game is won in one turn, the second in two
        trajs, _ = asyncio.run(run_trajectories(rows, Scripted(tok, lambda p: "9" if "No." in p else "3"), tok,
                                                AgentSettings(max_assistant_turns=5, response_budget=96), SamplingParams(max_new_tokens=96)))
    finally:
        stop()
    assert [(t.reward, t.num_turns, t.finish) for t in trajs] == [(1.0, 1, "env_done"), (1.0, 2, "env_done")]
    text = tok.decode(trajs[1].prompt_ids + trajs[1].response_ids)
    assert "Guess my digit." in text and "No." in text  # the server's observations are the user turns


def test_openenv_bad_url_is_named(tok):
    from hybridflow.agent.envs import make_env

    with pytest.raises(ValueError, match="env_kwargs.url"):
        make_env("openenv", {"url": "localhost:8000"})
