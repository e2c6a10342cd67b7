"""One sample's score as plain values: the part of the reward manager that runs where the reward
function runs (on the driver, or in a reward worker: ``workers.py``). Torch-free.

``score_sample`` calls ``compute_score`` once, under ``custom_reward_function.timeout_s``, and turns
what it returned, raised or did not return in time into a :class:`SampleResult`; the manager adds the
results up into scores and metrics (``manager.py``) the same way wherever they were computed, so a
pool of reward workers gives exactly what the driver alone gives.
"""

from __future__ import annotations

import numbers
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hybridflow.rewards.deadline import DeadlinePassed, SampleDeadline, bound

STOP_GRACE_S = 10.0  # past a deadline: the most we wait for the sample's sandboxes to be killed (milliseconds, normally)


class RewardTimeout(Exception):
    """A reward call exceeded custom_reward_function.timeout_s."""


@dataclass
class SampleResult:
    """What scoring one sample gave. ``status``: "ok"; "error" (the function raised or returned
    something else: ``value`` 0.0, ``error`` says what); "timeout" (past timeout_s: 0.0); "config"
    (NotImplementedError: no scorer for the data_source, a configuration error the manager raises).
    ``extras``: the numeric keys of a returned dict other than "score", in its order (also those
    read before the sample turned out to be an error, as the manager always counted them)."""

    value: float = 0.0
    pred: Any = None
    extras: dict[str, float] = field(default_factory=dict)
    status: str = "ok"
    error: str = ""


def score_sample(compute_score: Callable, timeout_s: float | None, data_source: Any, solution_str: str, reward_model: Any,
                 extra_info: Any) -> SampleResult:
    out = SampleResult()
    try:
        gt = reward_model["ground_truth"] if isinstance(reward_model, dict) else reward_model
        value = call_with_deadline(compute_score, timeout_s, data_source=data_source, solution_str=solution_str, ground_truth=gt,
                                   extra_info=extra_info)
        if isinstance(value, dict):
            if "score" not in value:
                raise ValueError(f"reward function returned a dict without 'score': {value!r:.200}")
            out.pred = value.get("pred")
            for k, v in value.items():
                if k != "score" and isinstance(v, numbers.Number) and not isinstance(v, bool):
                    out.extras[k] = float(v)
            value = value["score"]
        torch = sys.modules.get("torch")  # a tensor can only come from a function that imported torch
        if torch is not None and isinstance(value, torch.Tensor):
            value = value.item()
        if not isinstance(value, numbers.Number):
            raise TypeError(f"reward function returned {type(value).__name__}, expected a float or a dict with 'score'")
        out.value = float(value)
    except NotImplementedError as e:  # no scorer for this data_source: a configuration error, not a bad sample
        out.status, out.error, out.value = "config", str(e), 0.0
    except RewardTimeout:
        out.status, out.value = "timeout", 0.0
    except Exception as e:  # noqa: BLE001 - a bad sample must not stop the batch
        out.status, out.error, out.value = "error", f"{type(e).__name__}: {e}", 0.0
    return out


def call_with_deadline(fn: Callable, timeout_s: float | None, **kwargs):
    """fn(**kwargs), or RewardTimeout when it runs longer than timeout_s (None: no limit).

    The call runs in a thread of its own that sees the deadline (``deadline.current()``): the code
    reward's sandboxes end with it. A call that is not done at the deadline is abandoned (a daemon
    thread that cannot keep the process alive), after its sandbox runs in flight were killed."""
    if timeout_s is None:
        return fn(**kwargs)
    deadline = SampleDeadline(time.monotonic() + timeout_s)  # starts when the call starts, not when the batch was queued
    box: dict = {}

    def run() -> None:
        try:
            with bound(deadline):
                box["out"] = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["err"] = e

    thread = threading.Thread(target=run, daemon=True, name="reward-call")
    thread.start()
    thread.join(max(deadline.left(), 0.0))
    if thread.is_alive():
        deadline.wait_stopped(STOP_GRACE_S)  # its sandbox runs end at the deadline: wait for their kill
        raise RewardTimeout(f"no result within {timeout_s} s")
    if isinstance(box.get("err"), DeadlinePassed):
        raise RewardTimeout(f"no result within {timeout_s} s")
    if "err" in box:
        raise box["err"]
    return box["out"]
