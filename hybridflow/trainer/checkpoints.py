"""The run's checkpoint layout on disk, written atomically.

    <trainer.default_local_dir>/
      global_step_<k>/                      actor/ (and critic/) from the workers, trainer_state.pt
      latest_checkpointed_iteration.txt     k of the newest complete checkpoint

Every part of step k is written into `global_step_<k>.tmp`, which is renamed once complete; only
then does the latest-step file (itself replaced atomically) point at it. A crash at any moment
leaves the previous checkpoint as the latest. Old ones beyond trainer.max_ckpt_to_keep are deleted
afterwards. The trainer decides what goes in (`RLTrainer.save_checkpoint`).

Checkpoints are on by default (trainer.save_freq), and resume_mode auto picks up whatever the
directory holds, so a checkpoint records the keys that make a run what it is (`RUN_KEYS`); a run
whose keys differ is refused before any worker starts rather than resumed from another run's
weights (`check_same_run`).
"""

from __future__ import annotations

import os
import re
import shutil

from typing import Any

import torch

from hybridflow.config.schema import TrainerConfig
from hybridflow.config.tree import ConfigError

LATEST = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.pt"
# What a checkpoint must agree on with the run that resumes from it: the weights it holds, the data
# its position counts, the roles it has. Anything else (steps, logging, layout) may change on resume.
RUN_KEYS = ("actor_rollout_ref.model.path", "actor_rollout_ref.model.lora_rank", "critic.model.path", "critic.model.lora_rank",
            "algorithm.adv_estimator", "data.train_files")


def step_dir(root: str, step: int | str) -> str:
    return os.path.join(root, f"global_step_{step}")


def begin(root: str, step: int, clear: bool) -> str:
    """The directory the parts of step `step` are written into; clear: remove a partial one left
    by a crash (one process does)."""
    tmp = step_dir(root, step) + ".tmp"
    if clear:
        shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def commit(root: str, step: int, state: dict, keep: int | None) -> None:
    """Complete step `step` (its workers' parts are written): the trainer state, the rename, the
    latest-step file, then the retention of the newest `keep` checkpoints."""
    tmp, path = begin(root, step, clear=False), step_dir(root, step)
    torch.save(state, os.path.join(tmp, STATE))
    shutil.rmtree(path, ignore_errors=True)  # the same step saved before (a re-run)
    os.replace(tmp, path)
    with open(os.path.join(root, LATEST + ".tmp"), "w") as f:
        f.write(str(step))
    os.replace(os.path.join(root, LATEST + ".tmp"), os.path.join(root, LATEST))
    if keep:
        steps = sorted(int(d.split("_")[-1]) for d in os.listdir(root) if re.fullmatch(r"global_step_\d+", d))
        for old in steps[:-keep]:
            if old != step:
                shutil.rmtree(step_dir(root, old), ignore_errors=True)


def resume_path(t: TrainerConfig) -> str | None:
    """The checkpoint to resume from (trainer.resume_mode: auto = the latest in default_local_dir,
    resume_path = trainer.resume_from_path, disable), None for a fresh start."""
    if t.resume_mode == "disable":
        return None
    if t.resume_mode == "resume_path":
        return os.path.abspath(t.resume_from_path)
    latest = os.path.join(t.default_local_dir, LATEST)
    if not os.path.exists(latest):
        return None
    with open(latest) as f:
        return os.path.abspath(step_dir(t.default_local_dir, f.read().strip()))


def load_state(path: str) -> dict:
    return torch.load(os.path.join(path, STATE), weights_only=True)  # plain numbers and dicts


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def _norm(value: Any) -> Any:
    if isinstance(value, str):
        return os.path.normpath(value)
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    return value


def run_keys(cfg: Any) -> dict:
    """The `RUN_KEYS` of a config, as a checkpoint records them."""
    return {k: _norm(_get(cfg, k)) for k in RUN_KEYS}


def check_same_run(path: str, cfg: Any) -> None:
    """Refuse to resume (resume_mode auto) from checkpoint `path` when it was written by another run:
    a different model, algorithm or data in the same trainer.default_local_dir. A checkpoint from
    before the keys were recorded is not checked."""
    saved = load_state(path).get("run_keys")
    if not saved:
        return
    now = run_keys(cfg)
    diff = [f"{k}: {saved.get(k)!r} there, {now[k]!r} now" for k in RUN_KEYS if k in saved and _norm(saved[k]) != now[k]]
    if diff:
        root = cfg.trainer.default_local_dir
        raise ConfigError(f"trainer.default_local_dir={root} holds checkpoints of another run ({os.path.basename(path)}; "
                          f"{'; '.join(diff)}), which trainer.resume_mode=auto would resume from. Give this run its own "
                          f"trainer.default_local_dir=..., or start fresh there with trainer.resume_mode=disable "
                          f"(its checkpoints then replace that run's), or delete {root}")
