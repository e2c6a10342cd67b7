"""`hybridflow prepare`: local GSM8K- / MATH-style JSONL or parquet files -> the RL parquet schema.

    hybridflow prepare gsm8k_train.jsonl --format gsm8k --split train -o data/gsm8k/train.parquet
    hybridflow prepare math_test.parquet --format math --split test -o data/math/test.parquet
    hybridflow prepare --reasoning-gym chain_sum --size 2000 --seed 1 -o data/rg/train.parquet   (hybridflow/data/reasoning_gym.py)
    hybridflow prepare --verifiers my_taskset --size 500 -o data/vf/train.parquet                (hybridflow/agent/ecosystem.py)

What verl's `examples/data_preprocess/{gsm8k,math_dataset}.py` do, from files on disk (no hub):
each row becomes

    data_source   "openai/gsm8k" | "lighteval/MATH"   (--data-source to rename)
    prompt        [{"role": "user", "content": question + the format instruction}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": the final answer}
    extra_info    {"split", "index", "question", "answer": the full reference solution, ...}

GSM8K rows have `question` and `answer` (the final answer after `####`); MATH rows have `problem`
and `solution` (the final answer in the last `\\boxed{}`; `level` and `type` go to extra_info).
`--format auto` tells them apart by their columns. A row without its columns or without a final
answer stops the run with its file and row number (`--skip-bad` drops and counts such rows).
The default scorer (`hybridflow/rewards/scorers.py`) grades both data sources.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Callable

from hybridflow.data.dataset import DataError
from hybridflow.data.tasks import write_parquet
from hybridflow.rewards.math import last_boxed
from hybridflow.rewards.scorers import extract_gsm8k_answer


@dataclass(frozen=True)
class Format:
    data_source: str
    question_key: str
    answer_key: str
    instruction: str  # appended to the question (verl's wording)
    final_answer: Callable[[str], str | None]  # the reference solution -> the ground truth
    answer_place: str  # where final_answer looks, for the error message
    extra_keys: tuple[str, ...] = ()


FORMATS = {
    "gsm8k": Format("openai/gsm8k", "question", "answer", "Let's think step by step and output the final answer after \"####\".",
                    extract_gsm8k_answer, "after '####'"),
    "math": Format("lighteval/MATH", "problem", "solution", "Let's think step by step and output the final answer within \\boxed{}.",
                   last_boxed, "in a \\boxed{}", ("level", "type")),
}


def read_rows(path: str) -> list[dict]:
    """Rows of a .jsonl/.json-lines or .parquet file."""
    if not os.path.isfile(path):
        raise DataError(f"input file not found: {path}")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {i + 1}: not a JSON object ({e.msg})") from None
    return rows


def detect_format(path: str, row: dict) -> str:
    for name, fmt in FORMATS.items():
        if fmt.question_key in row and fmt.answer_key in row:
            return name
    raise DataError(f"{path}: cannot tell the format from its columns {sorted(row)} (GSM8K rows have question/answer, "
                    f"MATH rows problem/solution); pass --format and, for other names, --question-key/--answer-key")


def convert(path: str, fmt_name: str, split: str, data_source: str | None = None, question_key: str | None = None,
            answer_key: str | None = None, skip_bad: bool = False, start_index: int = 0) -> tuple[list[dict], int]:
    """The RL rows of one input file and how many bad rows were skipped."""
    rows = read_rows(path)
    if not rows:
        return [], 0
    fmt = FORMATS[detect_format(path, rows[0]) if fmt_name == "auto" else fmt_name]
    qk, ak = question_key or fmt.question_key, answer_key or fmt.answer_key
    out, skipped = [], 0
    for i, row in enumerate(rows):
        try:
            question, solution = row.get(qk), row.get(ak)
            if not isinstance(question, str) or not question.strip():
                raise DataError(f"{path} row {i}: no question in column {qk!r}")
            if not isinstance(solution, str):
                raise DataError(f"{path} row {i}: no reference solution in column {ak!r}")
            truth = fmt.final_answer(solution)
            if truth is None:
                raise DataError(f"{path} row {i}: the solution in {ak!r} has no final answer {fmt.answer_place}")
        except DataError:
            if not skip_bad:
                raise
            skipped += 1
            continue
        extra = {"split": split, "index": start_index + len(out), "question": question, "answer": solution}
        extra.update({k: row[k] for k in fmt.extra_keys if k in row})
        out.append({"data_source": data_source or fmt.data_source, "prompt": [{"role": "user", "content": f"{question} {fmt.instruction}"}],
                    "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": extra})
    return out, skipped


def main_prepare(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hybridflow prepare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", help="JSONL or parquet files (or --reasoning-gym)")
    p.add_argument("-o", "--output", required=True, help="the RL parquet file to write")
    p.add_argument("--format", default="auto", choices=["auto", *FORMATS])
    p.add_argument("--split", default="train", help="written to extra_info.split")
    p.add_argument("--data-source", default=None, help="instead of the format's (openai/gsm8k, lighteval/MATH)")
    p.add_argument("--question-key", default=None, help="the question's column, for files with other names")
    p.add_argument("--answer-key", default=None, help="the reference solution's column")
    p.add_argument("--skip-bad", action="store_true", help="drop rows without a final answer instead of stopping")
    p.add_argument("--limit", type=int, default=None, help="keep the first N rows")
    p.add_argument("--reasoning-gym", metavar="TASK", default=None,
                   help="generate TASK's entries with reasoning-gym instead of reading files (scored by its own verifier)")
    p.add_argument("--size", type=int, default=1000, help="--reasoning-gym: entries to generate")
    p.add_argument("--seed", type=int, default=0, help="--reasoning-gym: the dataset seed (entry i depends on seed + i)")
    p.add_argument("--rg-config", nargs="*", default=[], metavar="KEY=VALUE", help="--reasoning-gym: the task's config, e.g. max_terms=3")
    p.add_argument("--verifiers", metavar="TASKSET", default=None,
                   help="a verifiers (v1) taskset's tasks as rows of the `verifiers` environment (its rubric is the reward); --size: the first N")
    a = p.parse_args(argv)
    if a.verifiers or a.reasoning_gym:  # generated rows instead of files
        if a.inputs or (a.verifiers and a.reasoning_gym):
            p.exit(2, "hybridflow prepare: give input files, --reasoning-gym or --verifiers, one of them\n")
        try:
            if a.verifiers:
                from hybridflow.agent.ecosystem import make_verifiers_rows

                rows, what = make_verifiers_rows(a.verifiers, a.size, a.split), f"verifiers taskset {a.verifiers}"
            else:
                from hybridflow.data.reasoning_gym import make_rows, parse_config

                rows = make_rows(a.reasoning_gym, a.size, a.seed, parse_config(a.rg_config), a.split)
                what = f"reasoning-gym {a.reasoning_gym} (seed {a.seed})"
        except ValueError as e:
            p.exit(2, f"hybridflow prepare: {e}\n")
        rows = rows[:a.limit] if a.limit is not None else rows
        write_parquet(rows, a.output)
        print(f"wrote {len(rows)} rows of {what} to {a.output}")
        return 0
    if not a.inputs:
        p.exit(2, "hybridflow prepare: give input files (JSONL / parquet), --reasoning-gym TASK or --verifiers TASKSET\n")
    rows, skipped = [], 0
    try:
        for path in a.inputs:
            part, bad = convert(path, a.format, a.split, a.data_source, a.question_key, a.answer_key, a.skip_bad, len(rows))
            rows += part
            skipped += bad
    except DataError as e:
        p.exit(2, f"hybridflow prepare: {e}\n")
    rows = rows[:a.limit] if a.limit is not None else rows
    write_parquet(rows, a.output)
    print(f"wrote {len(rows)} rows to {a.output}" + (f" ({skipped} rows without a final answer skipped)" if skipped else ""))
    return 0
