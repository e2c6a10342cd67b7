"""A calculator with a heavy-tailed delay (what a real tool or sandbox call looks like), for bench/async.py."""

from __future__ import annotations

import asyncio
import random

from hybridflow.agent.tools import get_tool_class

Calculator = get_tool_class("calculator")


class SlowCalculator(Calculator):
    """The calculator after a Pareto(1.5)-distributed delay: median ~0.08 s, 1 call in 50 over 0.7 s (capped at 2 s)."""

    rng = random.Random(0)

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(min(0.05 * self.rng.paretovariate(1.5), 2.0))
        return await super().execute(instance_id, parameters, **kwargs)
