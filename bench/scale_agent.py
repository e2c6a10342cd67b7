"""A black-box agent for bench/agent_scale.py, written against the `openai` client alone: three chat
turns, each continuing the conversation with the model's reply and one more user message; its
reward is 1.0 when all three were answered. As a function (`rollout(client, row)`) or as a command
(the row as JSON on stdin, OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL from the environment, the
reward on its last stdout line)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import openai

TURNS = 3
MAX_TOKENS = 8


async def rollout(client: openai.AsyncOpenAI, row: dict) -> float:
    messages = list(row["messages"])
    for turn in range(TURNS):
        reply = await client.chat.completions.create(model=row["model"], messages=messages, max_tokens=MAX_TOKENS)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}, {"role": "user", "content": f"and {turn}?"}]
    return 1.0


async def _main() -> None:
    row = json.loads(sys.stdin.read())
    row.setdefault("model", os.environ["OPENAI_MODEL"])
    async with openai.AsyncOpenAI(max_retries=0, timeout=600) as client:
        print(await rollout(client, row))


if __name__ == "__main__":
    asyncio.run(_main())
