"""Task data played against an environment, for the ``guess`` demo recipe.

``make_guess_task`` writes RL rows for the ``guess`` environment (envs.py) and SFT conversations made
by *playing* that environment, so the demonstrations hold its messages token for token. Two
strategies are demonstrated: counting up from the low end (``scan``: many turns, and games whose
number is above ``lo + max_turns - 1`` run out of guesses) and bisection (at most
ceil(log2(hi - lo + 1)) turns). Scan is the majority (``scan_prob``), so the SFT model counts; GRPO
with the environment's turn penalty (a solved game pays 1 - turn_penalty * (turns - 1)) moves it to
bisection: more games solved, fewer turns per solved game.
"""

from __future__ import annotations

import pathlib
import random

from hybridflow.agent.envs import GuessNumberEnv
from hybridflow.data.tasks import write_parquet

GUESS_DATA_SOURCE = "guess"


def guess_prompt(lo: int, hi: int) -> list[dict]:
    return [{"role": "user", "content": f"Guess my number from {lo} to {hi}."}]


def play(env: GuessNumberEnv, row: dict, strategy: str) -> list[dict]:
    """The conversation of one game (the row's prompt, then guess / reply turns) up to its last guess."""
    env.reset(row)
    lo, hi = env.lo, env.hi
    messages = list(row["prompt"])
    while True:
        guess = lo if strategy == "scan" else (lo + hi) // 2
        messages.append({"role": "assistant", "content": str(guess)})
        reply, _, done = env.step(str(guess))
        if done:
            return messages
        messages.append({"role": "user", "content": reply})
        lo, hi = (guess + 1, hi) if reply.startswith("higher") else (lo, guess - 1)


def make_guess_task(out_dir, lo: int = 1, hi: int = 10, max_turns: int = 10, turn_penalty: float = 0.1, n_train: int = 512,
                    n_val: int = 60, n_sft: int = 1200, scan_prob: float = 0.7, seed: int = 0) -> dict[str, pathlib.Path]:
    """Write ``train.parquet`` / ``val.parquet`` (targets drawn uniformly; the val games every target
    equally often) and ``sft.parquet`` (played conversations)."""
    if not 0.0 <= scan_prob <= 1.0:
        raise ValueError(f"scan_prob must be in [0, 1], got {scan_prob}")
    out = pathlib.Path(out_dir)
    rng = random.Random(seed)
    env_kwargs = {"lo": lo, "hi": hi, "max_turns": max_turns, "turn_penalty": turn_penalty}

    def row(split: str, i: int, target: int) -> dict:
        return {"data_source": GUESS_DATA_SOURCE, "prompt": guess_prompt(lo, hi), "reward_model": {"style": "rule", "ground_truth": str(target)},
                "extra_info": {"split": split, "index": i, "env": "guess", "target": target, "env_kwargs": env_kwargs}}

    train = [row("train", i, rng.randint(lo, hi)) for i in range(n_train)]
    val = [row("val", i, lo + i % (hi - lo + 1)) for i in range(n_val)]
    env = GuessNumberEnv(env_kwargs)
    sft = [{"messages": play(env, r, "scan" if rng.random() < scan_prob else "bisect")} for r in rng.choices(train, k=n_sft)]
    return {
        "train": write_parquet(train, out / "train.parquet"),
        "val": write_parquet(val, out / "val.parquet"),
        "sft": write_parquet(sft, out / "sft.parquet"),
    }
