"""The code reward on reward workers (reward_model.num_workers) against the driver alone.

64 code samples x 5 test cases (assert-style checks graded out of the solution's process and stdin /
stdout cases; about 70% of them pass), each case its own sandbox run. Scored
by the RewardManager on the driver, one sample after another (0 workers), then on pools of 1, 2
and 4 reward workers (Ray actors). Every pool must give exactly the driver's scores and metrics.
A pool is started and warmed (every worker has scored a sample, so its sandbox backend is chosen)
before its clock starts: the table is the steady state of a training run, where the pool lives
for the whole run.

Each sandbox run is mostly CPU work (a fresh namespace and interpreter: ~60-80 ms on an idle core), so the
gain is bounded by the machine's idle cores; ``--case-sleep-s`` makes every program wait first, which
shows the overlap itself on a small or busy machine.

Run:  .venv/bin/python bench/reward_workers.py [--samples 64] [--workers 1,2,4] [--timeout-s none] [--case-sleep-s 0]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROGRAMS = [  # right, a wrong add, a wrong program, a wrong add on negative numbers
    "def add(a, b):\n    return a + b\n\nprint(sum(map(int, input().split())))\n",
    "def add(a, b):\n    return a - b\n\nprint(sum(map(int, input().split())))\n",
    "def add(a, b):\n    return a + b\n\nprint(0)\n",
    "def add(a, b):\n    return abs(a) + b\n\nprint(sum(map(int, input().split())))\n",
]
CASES = [
    "assert add(1, 2) == 3",
    "assert add(-1, 1) == 0",
    {"input": "2 3", "output": "5"},
    {"input": "10 -4", "output": "6"},
]


def samples(n: int, sleep_s: float = 0.0) -> list[tuple[str, str, object]]:
    out = []
    for i in range(n):
        code = (f"import time\ntime.sleep({sleep_s})\n" if sleep_s else "") + PROGRAMS[i % len(PROGRAMS)]
        truth = CASES + [{"input": f"{i} {i}", "output": str(2 * i)}]
        out.append(("code", f"Here it is:\n```python\n{code}```", truth))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--timeout-s", default="none", help="custom_reward_function.timeout_s for every run (none: no limit)")
    ap.add_argument("--case-sleep-s", type=float, default=0.0,
                    help="every program first sleeps this long (a program that waits: the pool's overlap without CPU contention)")
    args = ap.parse_args()
    timeout = None if args.timeout_s == "none" else float(args.timeout_s)

    import torch

    from hybridflow.controller.worker_group import init_ray
    from hybridflow.protocol import Batch
    from hybridflow.rewards.manager import RewardManager

    class CharTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    def batch_of(rows):
        T = max(len(t) for _, t, _ in rows)
        ids = torch.zeros((len(rows), T), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (_, text, _) in enumerate(rows):
            ids[i, :len(text)] = torch.tensor([ord(c) for c in text])
            mask[i, :len(text)] = 1
        return Batch(tensors={"responses": ids, "response_mask": mask},
                     non_tensors={"data_source": [s for s, _, _ in rows], "reward_model": [{"ground_truth": g} for _, _, g in rows]})

    rows = samples(args.samples, args.case_sleep_s)
    load_before = os.getloadavg()[0]
    batch = batch_of(rows)
    init_ray(num_cpus=os.cpu_count())
    table = []
    reference = None
    for n in [0] + [int(x) for x in args.workers.split(",") if x]:
        mgr = RewardManager(CharTokenizer(), timeout_s=timeout, num_workers=n)
        try:
            mgr(batch_of(rows[:max(n, 1)]))  # start (and warm) the pool; on the driver: the sandbox backend chosen
            start = time.perf_counter()
            scores, metrics = mgr(batch)
            took = time.perf_counter() - start
        finally:
            mgr.close()
        if reference is None:
            reference = (scores, metrics)
        same = torch.equal(scores, reference[0]) and metrics == reference[1]
        table.append((n, took, same, metrics["reward/mean"], metrics["reward/timeouts"]))
    cases = sum(len(t) for _, _, t in rows)
    sleep = f", each program sleeping {args.case_sleep_s:g} s first" if args.case_sleep_s else ""
    print(f"\ncode reward: {args.samples} samples x 5 test cases ({cases} sandbox runs{sleep}), timeout_s={timeout}, "
          f"{os.cpu_count()} CPUs on this machine, load average {load_before:.1f} at the start and {os.getloadavg()[0]:.1f} at the end\n")
    print(f"{'scored on':<22}{'seconds':>9}{'samples/s':>11}{'speedup':>9}  {'reward/mean':>11}  same as driver")
    base = table[0][1]
    for n, took, same, mean, _ in table:
        where = "driver, sequential" if n == 0 else f"{n} reward worker{'s' if n > 1 else ''}"
        print(f"{where:<22}{took:>9.2f}{args.samples / took:>11.1f}{base / took:>8.2f}x  {mean:>11.4f}  {'yes' if same else 'NO'}")
    if not all(same for _, _, same, _, _ in table):
        sys.exit("a pool's scores or metrics differ from the driver's")


if __name__ == "__main__":
    main()
