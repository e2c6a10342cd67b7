"""Metric logging, one `Tracker.log(metrics, step)` per step to every configured backend:

- console: a compact table row per step;
- jsonl: `<log_dir>/metrics.jsonl`, one object per step (what `hybridflow plot` reads);
- tensorboard: event files in `<log_dir>/tensorboard` (torch's SummaryWriter);
- wandb: a run in `<log_dir>` (WANDB_MODE=offline works with no network; `wandb sync` later);
- prometheus (`trainer.prometheus.port`): the latest value of every metric served as a gauge
  `hybridflow_<metric>` (non-alphanumerics -> `_`) on host:port/metrics (`utils/prometheus.py`).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Iterable

# The columns of the console table, in order (short header, metric key, format).
CONSOLE_COLUMNS = [
    ("step", "step", "{:>5d}"),
    ("score", "critic/score/mean", "{:>6.3f}"),
    ("val_acc", "val-core/*", "{:>7.3f}"),
    ("pg_loss", "actor/pg_loss", "{:>8.4f}"),
    ("ppo_kl", "actor/ppo_kl", "{:>9.2e}"),
    ("entropy", "actor/entropy", "{:>7.3f}"),
    ("grad", "actor/grad_norm", "{:>6.3f}"),
    ("vf_loss", "critic/vf_loss", "{:>7.4f}"),
    ("resp_len", "response_length/mean", "{:>8.2f}"),
    ("step_s", "timing_s/step", "{:>6.2f}"),
]
# DPO (`trainer/dpo.py`): TRL's metric names.
DPO_CONSOLE_COLUMNS = [
    ("step", "step", "{:>5d}"),
    ("score", "critic/score/mean", "{:>6.3f}"),
    ("val_acc", "val-core/*", "{:>7.3f}"),
    ("loss", "train/loss", "{:>7.4f}"),
    ("margins", "rewards/margins", "{:>8.4f}"),
    ("acc", "rewards/accuracies", "{:>6.3f}"),
    ("grad", "actor/grad_norm", "{:>6.3f}"),
    ("step_s", "timing_s/step", "{:>6.2f}"),
]


def _lookup(metrics: dict, key: str):
    if key.endswith("*"):
        hits = [v for k, v in metrics.items() if k.startswith(key[:-1])]
        return hits[0] if hits else None
    return metrics.get(key)


def _width(fmt: str) -> int:
    return len(fmt.format(0 if "d" in fmt else 0.0))


LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


class Tracker:
    def __init__(self, loggers: Iterable[str], log_dir: str | None, stream=None, columns: list[tuple[str, str, str]] = CONSOLE_COLUMNS,
                 project: str = "hybridflow", run_name: str = "run", config: dict | None = None, prometheus=None):
        """prometheus: a `utils.prometheus.MetricsExporter` (or None)."""
        self.loggers = set(loggers)
        self.columns = columns
        self.stream = stream or sys.stdout
        self.jsonl = self.tb = self.wandb_run = None
        self.prometheus = prometheus
        self._header_done = False
        if log_dir and self.loggers & {"jsonl", "tensorboard", "wandb"}:
            os.makedirs(log_dir, exist_ok=True)
        if "jsonl" in self.loggers and log_dir:
            self.jsonl_path = os.path.join(log_dir, "metrics.jsonl")
            self.jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(log_dir or ".", "tensorboard"))
        if "wandb" in self.loggers:
            import wandb

            self.wandb_run = wandb.init(project=project, name=run_name, dir=log_dir, config=config or {}, reinit="finish_previous")

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for k, v in numeric.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(numeric, step=step)
        if self.prometheus is not None:
            self.prometheus.update(numeric, step)
        if "console" in self.loggers:
            self._console(dict(metrics, step=step))

    def _console(self, metrics: dict) -> None:
        if not self._header_done:
            self._write(" | ".join(f"{h:>{_width(f)}}" for h, _, f in self.columns))
            self._header_done = True
        cells = []
        for h, k, f in self.columns:
            v = _lookup(metrics, k)
            cells.append(f.format(v) if v is not None else "-".rjust(_width(f)))
        self._write(" | ".join(cells))

    def _write(self, line: str) -> None:
        # tqdm.write keeps the table above a live progress bar instead of interleaving with it.
        from tqdm import tqdm

        tqdm.write(line, file=self.stream)
        self.stream.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.prometheus is not None:
            self.prometheus.close()
