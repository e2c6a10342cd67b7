"""A verifiers (v1) taskset: three sums; the rubric rewards the right number (weight 1) and a short
reply (weight 0.5: 1 / (1 + characters)), so the reward is a known function of the reply's text."""

from __future__ import annotations

import re

import verifiers.v1 as vf

__all__ = ["ArithTaskset"]

ROWS = [("2+3", "5"), ("4+4", "8"), ("1+6", "7")]


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        numbers = re.findall(r"\d+", trace.last_reply or "")
        return float(bool(numbers) and numbers[-1] == task.answer)

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply or ""))


class ArithTaskset(vf.Taskset[ArithTask]):
    def load(self):
        for q, a in ROWS:
            yield ArithTask(ArithData(prompt=f"{q}=", answer=a, system_prompt="Answer with a number."), self.config.task)


def expected_reward(index: int, reply: str) -> float:
    numbers = re.findall(r"\d+", reply)
    return float(bool(numbers) and numbers[-1] == ROWS[index][1]) + 0.5 / (1.0 + len(reply))
