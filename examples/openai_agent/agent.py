"""A calculator agent written against any OpenAI-compatible endpoint: it imports `openai`, not hybridflow.

It plays one multiplication question ("What is 423*756?"): asks the model with a `calculator` tool,
runs the calls the model makes (plain Python arithmetic), sends the results back as `role: tool`
messages, and scores the model's final answer itself (1.0 when its last integer is the product).

Two ways hybridflow runs it for training (docs/agents.md "Black-box agents"):

    actor_rollout_ref.rollout.agent.function=examples/openai_agent/agent.py:rollout   # in the driver's event loop
    actor_rollout_ref.rollout.agent.command="python examples/openai_agent/agent.py"    # a process per trajectory

As a command it reads OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL from its environment (as any
openai program does), the row as JSON on stdin, and prints its reward as the last line. Against any
other server it runs the same: `echo '{"messages": [{"role": "user", "content": "What is 12*34?"}]}' |
OPENAI_BASE_URL=... OPENAI_API_KEY=... OPENAI_MODEL=... python agent.py`.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
import re
import sys

import openai

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 123*456"}},
                   "required": ["expression"]}}}
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """+, - and * over integers (anything else is an error message for the model to read)."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and abs(node.value) < 10**9:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("only integers with + - *")
    try:
        return str(ev(ast.parse(str(expression), mode="eval").body))
    except (ValueError, SyntaxError, RecursionError) as e:
        return f"error: {e}"


def score(question: str, answer: str) -> float:
    a, b = map(int, re.search(r"(\d+)\s*\*\s*(\d+)", question).groups())
    numbers = re.findall(r"-?\d+", answer)
    return float(bool(numbers) and int(numbers[-1]) == a * b)


async def rollout(client: openai.AsyncOpenAI, row: dict) -> float:
    """One episode: at most one round of tool calls, then the answer."""
    model = row.get("model") or os.environ.get("OPENAI_MODEL", "policy")
    messages = list(row["messages"])
    question = messages[-1]["content"]
    reply = (await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR])).choices[0].message
    if reply.tool_calls:
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except json.JSONDecodeError:
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
        reply = (await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR])).choices[0].message
    return score(question, reply.content or "")


async def main() -> None:
    row = json.load(sys.stdin)
    async with openai.AsyncOpenAI() as client:  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        print(json.dumps({"reward": await rollout(client, row)}))


if __name__ == "__main__":
    asyncio.run(main())
