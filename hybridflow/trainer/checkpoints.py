"""The run's checkpoint layout on disk, written atomically.

    <trainer.default_local_dir>/
      global_step_<k>/                      actor/ (and critic/) from the workers, trainer_state.pt
      latest_checkpointed_iteration.txt     k of the newest complete checkpoint

Every part of step k is written into `global_step_<k>.tmp`, which is renamed once complete; only
then does the latest-step file (itself replaced atomically) point at it. A crash at any moment
leaves the previous checkpoint as the latest. Old ones beyond trainer.max_ckpt_to_keep are deleted
afterwards. The trainer decides what goes in (`RLTrainer.save_checkpoint`).
"""

from __future__ import annotations

import os
import re
import shutil

import torch

from hybridflow.config.schema import TrainerConfig

LATEST = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.pt"


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
