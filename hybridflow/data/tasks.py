"""Built-in offline task generators (verl parquet schema).

``arith_add``: single-digit addition ``a+b`` (a, b in 0..9). The RL files hold the 100 pairs split
into train / val (val is held out from RL training); the SFT file holds biased demonstrations over
all 100 pairs: with probability ``bias_prob`` the demonstrated answer is ``a+b+bias_offset``. An SFT
model absorbs that systematic error; RL with the exact-answer reward removes it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random

ARITH_DATA_SOURCE = "arith_add"


def write_parquet(rows: list[dict], path) -> pathlib.Path:
    """Write a list of row dicts (nested lists/dicts allowed) to a parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(list(rows))
    pq.write_table(table, path)
    return path


def addition_prompt(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"{a}+{b}="}]


def make_addition_task(
    out_dir,
    val_fraction: float = 0.25,
    sft_copies: int = 8,
    bias_prob: float = 0.75,
    bias_offset: int = 1,
    seed: int = 0,
) -> dict[str, pathlib.Path]:
    """Write ``train.parquet``, ``val.parquet`` (RL) and ``sft.parquet`` into ``out_dir``.

    Returns ``{"train": path, "val": path, "sft": path}``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if not 0.0 <= bias_prob <= 1.0:
        raise ValueError(f"bias_prob must be in [0, 1], got {bias_prob}")
    if sft_copies < 1:
        raise ValueError(f"sft_copies must be >= 1, got {sft_copies}")
    out = pathlib.Path(out_dir)
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    shuffled = pairs[:]
    rng.shuffle(shuffled)
    n_val = max(1, min(len(pairs) - 1, round(len(pairs) * val_fraction)))
    val_pairs = sorted(shuffled[:n_val])
    train_pairs = sorted(shuffled[n_val:])

    def rl_rows(split: str, split_pairs):
        return [
            {
                "data_source": ARITH_DATA_SOURCE,
                "prompt": addition_prompt(a, b),
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i, "a": a, "b": b},
            }
            for i, (a, b) in enumerate(split_pairs)
        ]

    sft_rows = []
    for a, b in pairs:
        for _ in range(sft_copies):
            wrong = rng.random() < bias_prob
            ans = a + b + (bias_offset if wrong else 0)
            sft_rows.append({"prompt": addition_prompt(a, b), "response": str(ans)})
    rng.shuffle(sft_rows)

    return {
        "train": write_parquet(rl_rows("train", train_pairs), out / "train.parquet"),
        "val": write_parquet(rl_rows("val", val_pairs), out / "val.parquet"),
        "sft": write_parquet(sft_rows, out / "sft.parquet"),
    }


def main_make_data(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hybridflow make-data", description="Write the built-in arith_add task files")
    p.add_argument("out_dir")
    p.add_argument("--task", default="arith_add", choices=["arith_add"])
    p.add_argument("--val-fraction", type=float, default=0.25)
    p.add_argument("--sft-copies", type=int, default=8)
    p.add_argument("--bias-prob", type=float, default=0.75)
    p.add_argument("--bias-offset", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    files = make_addition_task(
        a.out_dir,
        val_fraction=a.val_fraction,
        sft_copies=a.sft_copies,
        bias_prob=a.bias_prob,
        bias_offset=a.bias_offset,
        seed=a.seed,
    )
    print(json.dumps({k: str(v) for k, v in files.items()}))
    return 0
