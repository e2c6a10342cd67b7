"""`hybridflow plot METRICS.jsonl -o curves.png`: the curves users look at, one panel each.

Panels (a metric absent from the log leaves its panel empty, titled "no data"):
reward (critic/score/mean), held-out accuracy (val-core/*), KL (actor/ppo_kl, actor/kl_loss),
response length (response_length/mean) and resharding time (timing_s/reshard, or
timing_s/sync_weights across pools), each against the step.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Iterable

PANELS = [
    ("reward", ["critic/score/mean"]),
    ("held-out accuracy", ["val-core/*"]),
    ("KL", ["actor/ppo_kl", "actor/kl_loss"]),
    ("response length", ["response_length/mean"]),
    ("reshard time (s)", ["timing_s/reshard", "timing_s/sync_weights"]),
]


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _series(rows: Iterable[dict], pattern: str) -> dict[str, tuple[list, list]]:
    """{metric: (steps, values)} for the metrics matching `pattern` (a trailing * is a prefix)."""
    out: dict[str, tuple[list, list]] = {}
    for row in rows:
        for key, value in row.items():
            hit = key.startswith(pattern[:-1]) if pattern.endswith("*") else key == pattern
            if hit and isinstance(value, (int, float)) and "step" in row:
                steps, values = out.setdefault(key, ([], []))
                steps.append(row["step"])
                values.append(value)
    return out


def plot_metrics(rows: list[dict], out_path: str, title: str | None = None) -> str:
    """Draw the panels for `rows` (metrics.jsonl objects, each with "step") into a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2), constrained_layout=True)
    for ax, (name, patterns) in zip(axes, PANELS):
        drawn = False
        for pattern in patterns:
            for key, (steps, values) in _series(rows, pattern).items():
                ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, label=key)
                drawn = True
        ax.set_title(name if drawn else f"{name}: no data", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=11)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def main_plot(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hybridflow plot", description="Plot reward, accuracy, KL, response length and reshard time per step")
    p.add_argument("metrics", help="a metrics.jsonl written by trainer.logger=[jsonl]")
    p.add_argument("-o", "--output", default="curves.png")
    a = p.parse_args(argv)
    if not os.path.isfile(a.metrics):
        raise SystemExit(f"error: {a.metrics} does not exist (runs write <trainer.default_local_dir>/metrics.jsonl)")
    try:
        rows = read_jsonl(a.metrics)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot read {a.metrics} as JSON lines: {e}") from None
    print(plot_metrics(rows, a.output, title=os.path.basename(os.path.dirname(os.path.abspath(a.metrics)))))
    return 0
