"""Built-in offline task generators (verl parquet schema).

``digit_max`` (the demo's task): "max 3 8 1" -> "8", over ordered triples of distinct digits. The
triples are split into RL train and val (val is held out from BOTH SFT and RL: answering it needs
the rule, not a memorised fact). SFT demonstrations follow the wrong rule (the MINIMUM) with
probability ``bias_prob``: the SFT model learns both rules and prefers the wrong one, so its
greedy accuracy is near 0; GRPO with the exact-answer reward switches it to the right rule, and
the switch carries over to the held-out triples. The same split also gives an offline preference
task (`pref_train.parquet`, `pref_val.parquet`): for each triple, chosen = the right rule's answer
(the maximum), rejected = the minimum, the next smallest digit, and a digit absent from the prompt, so a
preference learner's progress is measured by the same rule scorer on the held-out triples.

``multiply`` (the tool demo's task): "What is 423*756?" -> "319788", 3-digit operands from
``min_operand`` (320: every product has 6 digits, so the tool's result and the answer sit at fixed
offsets, which a tiny model learns to copy by position), a product the tiny model cannot compute in
its head. RL rows go through the multi-turn agent loop with the ``calculator`` tool
(``tool_config.yaml``, verl's shape). Two SFT files of multi-turn conversations (``messages``: user,
assistant tool call, tool result, assistant answer), both over the train pairs only:
``sft_copy.parquet``, where every conversation calls the tool with the exact operands and copies its
result (the copy skill a pretrained model brings; a 2-layer model forms those copies abruptly, at a
step that varies by seed, and only when most of what it sees teaches them), and ``sft.parquet``,
often wrong: with ``direct_prob`` the demonstration answers without the tool (a wrong guess near the
product), and a tool-using one passes bad arguments with ``bad_args_prob`` (the second operand
rounded down to tens: ``423*750``). With the defaults (60% in the head, every call exact) the SFT
model's greedy answer is a guess in the head (never right) and sampling calls the tool ~40% of the
time; GRPO with the exact-answer reward (the last integer of the model's own tokens) moves it to
the tool (docs/agents.md has what else was tried).

``code`` (the code recipe's task): ``digit_max``'s prompts, triples and held-out split with a
program as the answer: "max 3 8 1" -> ``f=lambda:max(3,8,1)``, graded by the built-in code reward
(``data_source="code"``: hybridflow/rewards/code.py runs the response in the sandbox against
``ground_truth``, a list with one assert-style check, ``assert f() == 8``; the score is the fraction
of checks passed). SFT demonstrations write the wrong rule's program (``min(...)``) with probability
``bias_prob``, so the SFT model's greedy program returns the minimum and fails the check; GRPO with
the code reward switches it to ``max``. One check per row keeps a step cheap: each check is one
sandbox run (~50 ms), scored one sample after another.

``arith_add``: single-digit addition ``a+b`` (a, b in 0..9). The RL files hold the 100 pairs split
into train / val (val is held out from RL training); the SFT file holds biased demonstrations over
all 100 pairs: with probability ``bias_prob`` the demonstrated answer is ``a+b+bias_offset``. An SFT
model absorbs that systematic error; RL with the exact-answer reward removes it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import random

ARITH_DATA_SOURCE = "arith_add"
MAX_DATA_SOURCE = "digit_max"
MULTIPLY_DATA_SOURCE = "multiply"
CODE_DATA_SOURCE = "code"
# The tool demo's calculator: the schema the RL prompt renders (tool_config.yaml) and the SFT rows carry.
CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


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


def max_prompt(digits: tuple[int, ...]) -> list[dict]:
    return [{"role": "user", "content": "max " + " ".join(map(str, digits))}]


def _digit_split(num_digits: int, val_fraction: float, bias_prob: float, seed: int):
    """(rng, train triples, held-out triples) shared by digit_max and the code task: the same
    arguments give the same triples, order and split (the rng continues into the SFT draws)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if not 0.0 <= bias_prob <= 1.0:
        raise ValueError(f"bias_prob must be in [0, 1], got {bias_prob}")
    if not 2 <= num_digits <= 10:
        raise ValueError(f"num_digits must be in [2, 10], got {num_digits}")
    rng = random.Random(seed)
    combos = list(itertools.permutations(range(10), num_digits))
    rng.shuffle(combos)
    n_val = max(1, round(len(combos) * val_fraction))
    return rng, combos[n_val:], combos[:n_val]


def _digit_rows(split: str, combos, data_source: str, ability: str, ground_truth) -> list[dict]:
    """RL rows of the "max 3 8 1" prompts; ``ground_truth(digits)`` is the row's answer (or checks)."""
    return [{"data_source": data_source, "prompt": max_prompt(c), "ability": ability,
             "reward_model": {"style": "rule", "ground_truth": ground_truth(c)},
             "extra_info": {"split": split, "index": i, "digits": list(c)}}
            for i, c in enumerate(combos)]


def make_max_task(out_dir, num_digits: int = 3, val_fraction: float = 0.2, sft_copies: int = 2, bias_prob: float = 0.75,
                  seed: int = 0) -> dict[str, pathlib.Path]:
    """Write ``train.parquet``, ``val.parquet`` (RL), ``sft.parquet`` and the preference pairs
    ``pref_train.parquet`` / ``pref_val.parquet`` (the same train / held-out split) for ``digit_max``."""
    out = pathlib.Path(out_dir)
    rng, train, val = _digit_split(num_digits, val_fraction, bias_prob, seed)

    def rl_rows(split: str, split_combos):
        return _digit_rows(split, split_combos, MAX_DATA_SOURCE, "math", lambda c: str(max(c)))

    # Demonstrations only over the RL train triples: val stays unseen by SFT too.
    sft_rows = [
        {"prompt": max_prompt(c), "response": str(min(c) if rng.random() < bias_prob else max(c))}
        for c in train
        for _ in range(sft_copies)
    ]
    rng.shuffle(sft_rows)

    def pref_rows(split: str, split_combos):
        # Rejected: the wrong rule's answer (the minimum), the next smallest digit, and a digit absent
        # from the prompt, so a reward model learns "the largest digit shown", not "a large digit".
        return [
            {"data_source": MAX_DATA_SOURCE, "prompt": max_prompt(c), "chosen": str(max(c)), "rejected": str(wrong),
             "extra_info": {"split": split, "index": i, "digits": list(c)}}
            for i, c in enumerate(split_combos)
            for wrong in sorted(set(c) - {max(c)})[:2] + [rng.choice(sorted(set(range(10)) - set(c)))]
        ]

    return {
        "train": write_parquet(rl_rows("train", train), out / "train.parquet"),
        "val": write_parquet(rl_rows("val", val), out / "val.parquet"),
        "sft": write_parquet(sft_rows, out / "sft.parquet"),
        "pref_train": write_parquet(pref_rows("train", train), out / "pref_train.parquet"),
        "pref_val": write_parquet(pref_rows("val", val), out / "pref_val.parquet"),
    }


def code_answer(digits: tuple[int, ...], rule: str = "max") -> str:
    """The code task's program for ``digits``: ``f=lambda:max(3,8,1)`` (``rule="min"``: the wrong rule's)."""
    return f"f=lambda:{rule}({','.join(map(str, digits))})"


def make_code_task(out_dir, num_digits: int = 3, val_fraction: float = 0.2, sft_copies: int = 2, bias_prob: float = 0.75,
                   seed: int = 0) -> dict[str, pathlib.Path]:
    """Write ``train.parquet``, ``val.parquet`` (RL rows scored by the code reward) and ``sft.parquet``
    (programs over the train triples only, the wrong rule's with ``bias_prob``) for the ``code`` task.
    The triples, their order and the train / held-out split are ``make_max_task``'s for the same arguments."""
    out = pathlib.Path(out_dir)
    rng, train, val = _digit_split(num_digits, val_fraction, bias_prob, seed)

    def rl_rows(split: str, split_combos):
        return _digit_rows(split, split_combos, CODE_DATA_SOURCE, "code", lambda c: [f"assert f() == {max(c)}"])

    sft_rows = [
        {"prompt": max_prompt(c), "response": code_answer(c, "min" if rng.random() < bias_prob else "max")}
        for c in train
        for _ in range(sft_copies)
    ]
    rng.shuffle(sft_rows)
    return {
        "train": write_parquet(rl_rows("train", train), out / "train.parquet"),
        "val": write_parquet(rl_rows("val", val), out / "val.parquet"),
        "sft": write_parquet(sft_rows, out / "sft.parquet"),
    }


def multiply_prompt(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a}*{b}?"}]


def _tool_call(expression: str) -> str:
    """The hermes call the calculator demonstrations write (hybridflow/agent/format.py)."""
    return '<tool_call>\n' + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + '\n</tool_call>'


def make_multiply_task(out_dir, n_train: int = 2000, n_val: int = 100, n_sft: int = 3000, direct_prob: float = 0.6,
                       bad_args_prob: float = 0.0, min_operand: int = 320, seed: int = 0,
                       data_source: str = MULTIPLY_DATA_SOURCE) -> dict[str, pathlib.Path]:
    """Write ``train.parquet`` / ``val.parquet`` (RL, disjoint operand pairs), ``sft_copy.parquet`` (every
    call exact) and ``sft.parquet`` (the mix above; both multi-turn ``messages`` + ``tools``, ``n_sft``
    rows over the train pairs only) and ``tool_config.yaml``.

    Operands are drawn from ``min_operand..999``; 320 makes every product, the rounded ones too, 6 digits.
    ``data_source="agent"``: the RL rows are scored by the agent that plays them (the ``agent`` recipe's
    black-box agent) instead of the ``multiply`` rule."""
    for name, p in (("direct_prob", direct_prob), ("bad_args_prob", bad_args_prob)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {p}")
    if not 100 <= min_operand <= 999:
        raise ValueError(f"min_operand must be a 3-digit number (100..999), got {min_operand}")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < n_train + n_val:
        pairs.add((rng.randint(min_operand, 999), rng.randint(min_operand, 999)))
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    val, train = ordered[:n_val], ordered[n_val:]

    def rl_rows(split: str, split_pairs):
        return [{"data_source": data_source, "prompt": multiply_prompt(a, b), "ability": "math",
                 "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                 "extra_info": {"split": split, "index": i, "a": a, "b": b}} for i, (a, b) in enumerate(split_pairs)]

    def near_miss(x: int) -> int:
        """A wrong product "in the head": the leading digits right, the last three guessed."""
        guess = x - x % 1000 + rng.randrange(1000)
        return guess if guess != x else guess + 1

    def bad_call(a: int, b: int) -> tuple[str, int]:
        """(expression, its value): the second operand rounded down to tens, one consistent mistake
        (the greedy SFT model makes it; the product keeps its 6 digits)."""
        rounded = b - b % 10
        return f"{a}*{rounded}", a * rounded

    def conversation(p_direct: float, p_bad: float) -> list[dict]:
        a, b = rng.choice(train)
        messages = multiply_prompt(a, b)
        if rng.random() < p_direct:
            return messages + [{"role": "assistant", "content": f"The answer is {near_miss(a * b)}."}]
        expr, result = bad_call(a, b) if rng.random() < p_bad else (f"{a}*{b}", a * b)
        return messages + [{"role": "assistant", "content": _tool_call(expr)},
                           {"role": "tool", "content": str(result), "name": "calculator"},
                           {"role": "assistant", "content": f"The answer is {result}."}]

    tools = json.dumps([CALCULATOR_SCHEMA])
    sft_rows = [{"messages": conversation(direct_prob, bad_args_prob), "tools": tools} for _ in range(n_sft)]
    copy_rows = [{"messages": conversation(0.0, 0.0), "tools": tools} for _ in range(n_sft)]
    tool_config = out / "tool_config.yaml"
    tool_config.write_text(json.dumps({"tools": [{"class_name": "calculator", "config": {"type": "native"},
                                                  "tool_schema": CALCULATOR_SCHEMA}]}, indent=2) + "\n")  # JSON is YAML
    return {
        "train": write_parquet(rl_rows("train", train), out / "train.parquet"),
        "val": write_parquet(rl_rows("val", val), out / "val.parquet"),
        "sft": write_parquet(sft_rows, out / "sft.parquet"),
        "sft_copy": write_parquet(copy_rows, out / "sft_copy.parquet"),
        "tool_config": tool_config,
    }


def main_make_data(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hybridflow make-data",
                                description="Write a built-in task's train/val/sft parquet files (digit_max also writes preference pairs: pref_train/pref_val)")
    p.add_argument("out_dir")
    p.add_argument("--task", default="digit_max", choices=["digit_max", "arith_add", "code", "vision"],
                   help="vision: PIL-drawn circles, 'Which colour is the circle?' (data/vision_task.py), for a VLM (make-model --arch qwen2_vl)")
    p.add_argument("--val-fraction", type=float, default=None)
    p.add_argument("--sft-copies", type=int, default=None)
    p.add_argument("--bias-prob", type=float, default=0.75)
    p.add_argument("--bias-offset", type=int, default=1, help="arith_add only")
    p.add_argument("--num-digits", type=int, default=3, help="digit_max and code only")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    common = {"bias_prob": a.bias_prob, "seed": a.seed}
    if a.val_fraction is not None:
        common["val_fraction"] = a.val_fraction
    if a.sft_copies is not None:
        common["sft_copies"] = a.sft_copies
    if a.task == "vision":
        from hybridflow.data.vision_task import make_vision_task

        files = make_vision_task(a.out_dir, **{k: v for k, v in common.items() if k != "val_fraction"})
    elif a.task == "digit_max":
        files = make_max_task(a.out_dir, num_digits=a.num_digits, **common)
    elif a.task == "code":
        files = make_code_task(a.out_dir, num_digits=a.num_digits, **common)
    else:
        files = make_addition_task(a.out_dir, bias_offset=a.bias_offset, **common)
    print(json.dumps({k: str(v) for k, v in files.items()}))
    return 0
